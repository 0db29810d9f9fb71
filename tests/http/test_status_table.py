"""The one table of error statuses (node/http/errors.py STATUSES) covers the engine's errors:
a new error class without a row would leave the node as a 500 nobody chose."""

from __future__ import annotations

import node.http.app  # noqa: F401  (imports every module that defines engine errors)
from node.http.errors import STATUS, STATUSES
from node.storage.errors import StorageError, WalDeviceError

NEVER_ANSWERED = {WalDeviceError}  # raised while the node starts, before it serves


def _subclasses(cls: type[StorageError]) -> set[type[StorageError]]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def test_every_engine_error_has_a_status_row() -> None:
    missing = _subclasses(StorageError) - set(STATUS) - NEVER_ANSWERED
    assert not missing, f"no row in errors.STATUSES for {sorted(c.__name__ for c in missing)}"


def test_each_error_has_one_row() -> None:
    rows = [error for row in STATUSES.values() for error in row.errors]
    assert len(rows) == len(set(rows))
