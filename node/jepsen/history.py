"""Every client operation of a fault run, as Jepsen logs it: an ``invoke`` when it starts, then
``ok`` (it happened), ``fail`` (it certainly did not) or ``info`` (unknown: a timeout, an
AddOutcomeUnknown, a process killed before the answer). One JSON object per line::

    {"p": "w0", "type": "invoke", "f": "add", "ledger": 4611686018427387905,
     "entry": null, "digest": "9f2c...", "t": 1764170000.123}

``f`` is add | add_batch | close | recover, or a reader's read | read_lac | read_end, or a
stream's append | append_batch (node/jepsen/streams.py: ``ledger``/``entry`` are then the
position ``L:E`` it was given) and its readers' stream_read | cursor_create | cursor_read |
cursor_ack | cursor_reset. ``entry``: the id an add got (a batch: its first id), the lastEntryId
a close or a recovery ended at, the first id a read asked for (``last``: the last), the LAC an
open ledger's reader was told (read_lac) or the end of a closed one (read_end). ``digest``: the
payload's digest (a batch, or a read: a list, one per entry); payloads of a run are unique,
so a digest names its operation. A ledger read that ends early is logged with the digests it
got, from ``entry`` on; the id after them is the one that failed (``error``: ``absent`` when
every replica of its write set said it holds no such entry, else why it is unknown). A stream
read's ``positions`` are those of its digests; ``ledger``/``entry`` of a stream read, an ack
or a reset are the position it named (a plain read's ``from``).

Several processes each write their own file (a writer child appends line by line, so a
SIGKILL loses at most a torn last line); ``load`` merges them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal

OpType = Literal["invoke", "ok", "fail", "info"]
OpFunction = Literal[
    "add",
    "add_batch",
    "close",
    "recover",
    "read",
    "read_lac",
    "read_end",
    "append",
    "append_batch",
    "stream_read",
    "cursor_create",
    "cursor_read",
    "cursor_ack",
    "cursor_reset",
]
READS = frozenset({"read", "read_lac", "read_end", "stream_read", "cursor_read"})
ABSENT = "absent"  # ``error`` of a read every replica of the entry's write set said it lacks
DIGEST_BYTES = 16  # of BLAKE2b: unique enough for one run's payloads, short in the file


def digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).hexdigest()


@dataclass(frozen=True)
class Op:
    p: str  # the process (client) that ran it
    type: OpType
    f: OpFunction
    ledger: int | None = None
    entry: int | None = None
    digest: str | list[str] | None = None
    t: float = 0.0
    last: int | None = None  # the last id a ledger read asked for
    error: str | None = None  # why a read did not get everything (ABSENT: not there)
    positions: list[str] | None = None  # "L:E" of each digest a stream read returned

    def digests(self) -> list[str]:
        if self.digest is None:
            return []
        return [self.digest] if isinstance(self.digest, str) else list(self.digest)

    def entries(self) -> list[tuple[int, str]]:
        """(id, digest) of each entry of an ok add or add_batch."""
        if self.entry is None:
            return []
        return [(self.entry + i, d) for i, d in enumerate(self.digests())]

    def to_json(self) -> str:
        # The fields only reads use are left out when unset: adds stay as short as before.
        fields = {k: v for k, v in asdict(self).items() if v is not None or k not in _READ_ONLY}
        return json.dumps(fields, separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> Op:
        return Op(**json.loads(line))


_READ_ONLY = ("last", "error", "positions")


class History:
    """One process's operations, in memory and, with ``path``, appended to that file line by
    line (for processes that may be killed; the appends block, so asynchronous code under a
    blocking-call detector keeps ``path`` None and ``dump``s at the end)."""

    def __init__(self, process: str, path: Path | None = None) -> None:
        self.process = process
        self.ops: list[Op] = []
        self._file: IO[str] | None = path.open("a", buffering=1) if path else None

    def log(
        self,
        type_: OpType,
        f: OpFunction,
        ledger: int | None = None,
        entry: int | None = None,
        digest: str | list[str] | None = None,
        *,
        last: int | None = None,
        error: str | None = None,
        positions: list[str] | None = None,
    ) -> Op:
        op = Op(self.process, type_, f, ledger, entry, digest, time.time(), last, error, positions)
        self.ops.append(op)
        if self._file is not None:
            self._file.write(op.to_json() + "\n")
        return op

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def dump(self, path: Path) -> None:
        with path.open("w") as out:
            out.writelines(op.to_json() + "\n" for op in self.ops)


def read_ops(path: Path) -> Iterator[Op]:
    """The operations of one file; a torn last line (its process was killed) is skipped."""
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            yield Op.from_json(line)
        except (json.JSONDecodeError, TypeError):
            if i < len(lines) - 1 and lines[i + 1]:
                raise  # torn in the middle: not a kill
            return


def load(paths: Iterable[Path]) -> list[Op]:
    """Every file's operations, in time order."""
    ops = [op for path in paths for op in read_ops(path)]
    return sorted(ops, key=lambda op: op.t)


async def load_async(paths: Iterable[Path]) -> list[Op]:
    """``load`` off the event loop."""
    return await asyncio.to_thread(load, list(paths))


def merge(*histories: Iterable[Op]) -> list[Op]:
    return sorted((op for h in histories for op in h), key=lambda op: op.t)


def summary(ops: Iterable[Op]) -> dict[str, Any]:
    """Counts by type and function, e.g. {"ok": {"add": 12}, "info": {"add": 1}}."""
    counts: dict[str, dict[str, int]] = {}
    for op in ops:
        counts.setdefault(op.type, {}).setdefault(op.f, 0)
        counts[op.type][op.f] += 1
    return counts
