"""Named crash points (FoundationDB's BUGGIFY, reduced to its simplest form).

Tests set ``crash_points`` to make the node SIGKILL itself at an exact step of a
multi-step protocol (a checkpoint, a journal rotation), where a random kill would land
only by luck. With the setting empty, which is the default, a crash point costs one
set lookup.
"""

from __future__ import annotations

import os
import signal


class CrashPoints:
    def __init__(self, armed: frozenset[str]) -> None:
        self._armed = armed

    def hit(self, name: str) -> None:
        if name in self._armed:
            os.kill(os.getpid(), signal.SIGKILL)
