"""The fault points and the grammar of a fault entry (``<point>=<action>[,after=N][,times=N]``):
what the ``faults`` and ``crash_points`` settings may name, checked when the settings load.
The points fire in node/storage/faults.py (and the components that take its ``Faults``);
the grammar lives below the settings so that they validate an entry without importing the
engine.

The points (a fault elsewhere is refused at start, as a name that would never fire):

- I/O points (``IO_POINTS``), every action: ``journal.write`` and ``journal.fsync`` (the
  file journal's group write and its fdatasync), ``blockwal.write`` and ``blockwal.fsync``
  (the raw-device WAL's block writes and its sync thread's fdatasync), ``entrylog.write``
  and ``entrylog.fsync`` (a checkpoint's records into the entry log, and its flush),
  ``entrylog.read`` and ``index.get`` (a read's entry log read and its index lookup, on a
  reader thread: an I/O error there must answer ``io_error``, never "not found").
- Step points (``STEP_POINTS``, through ``hit``), ``eio``, ``delay`` and ``crash``: the
  crash points, and ``checkpoint.mark`` (just before lastMark is written);
  ``stream.rollover.after_record`` is a stream's record naming its new ledger written, the
  old one not closed yet; ``autorecovery.after_copy`` is a fragment copied to its
  replacement and read back, the segment's CAS not sent (a node's re-replication route).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

IO_POINTS = frozenset(
    {
        "journal.write",
        "journal.fsync",
        "blockwal.write",
        "blockwal.fsync",
        "entrylog.write",
        "entrylog.fsync",
        "entrylog.read",
        "index.get",
    }
)
STEP_POINTS = frozenset(
    {
        "checkpoint.before_entrylog",
        "checkpoint.after_entrylog_fsync",
        "checkpoint.after_index",
        "checkpoint.mark",
        "checkpoint.after_mark",
        "journal.rotate.before",
        "journal.rotate.after",
        "blockwal.trim.before_header",
        "blockwal.trim.after_header",
        "compaction.after_copy",
        "compaction.after_seal",
        "compaction.after_marker",
        "compaction.after_rename",
        "compaction.after_index",
        "compaction.after_retire",
        "offload.after_attempt_recorded",
        "offload.mid_upload",
        "offload.after_upload",
        "stream.rollover.after_record",
        "autorecovery.after_copy",
    }
)
Action = Literal["eio", "short", "short:crash", "delay", "crash"]
WRITE_ONLY: frozenset[Action] = frozenset({"short", "short:crash"})


@dataclass(slots=True)
class Fault:
    point: str
    action: Action
    delay_s: float = 0.0
    after: int = 0  # calls let through first
    times: int | None = None  # fires this many times; None: for good
    calls: int = 0
    cut: bool = False  # a short write happened: the next call fails

    def due(self) -> bool:
        """Count a call; whether the fault fires on it."""
        self.calls += 1
        fired = self.calls - self.after
        return fired > 0 and (self.times is None or fired <= self.times)


def parse(entry: str) -> Fault:
    """``<point>=<action>[,after=N][,times=N]``; ValueError says what is wrong."""
    point, sep, rest = entry.partition("=")
    if not sep or not point:
        raise ValueError(f"fault {entry!r}: expected <point>=<action>")
    action, *options = rest.split(",")
    fault = Fault(point, "eio")
    if action.startswith("delay:"):
        fault.action = "delay"
        try:
            fault.delay_s = float(action.removeprefix("delay:"))
        except ValueError:
            raise ValueError(f"fault {entry!r}: delay:<seconds> expected") from None
        if fault.delay_s < 0:
            raise ValueError(f"fault {entry!r}: a negative delay")
    elif action in get_args(Action) and action != "delay":
        fault.action = cast(Action, action)
    else:
        raise ValueError(
            f"fault {entry!r}: action {action!r} is not eio, short, short:crash, delay:S or crash"
        )
    if point not in IO_POINTS | STEP_POINTS:
        raise ValueError(f"fault {entry!r}: no point {point!r} (see node/faultpoints.py)")
    if fault.action in WRITE_ONLY and not point.endswith(".write"):
        raise ValueError(f"fault {entry!r}: a short write only happens at a .write point")
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("after", "times") or not value.isdigit():
            raise ValueError(f"fault {entry!r}: option {option!r} is not after=N or times=N")
        setattr(fault, key, int(value))
    return fault
