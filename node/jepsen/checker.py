"""What a fault run's history says must hold, checked against what fresh readers see.

After a run every ledger is read back by fresh clients, one per node order (``observe``), each
giving an ``Observation``; ``check`` compares them with the history and lists every violation:

=============  ==============================================================================
lost           an acknowledged (ok) entry is missing, or holds other bytes
short          the ledger ends before an acknowledged entry (lastEntryId < its id)
disagree       readers see different lastEntryIds (or a close/recovery ended elsewhere)
past_end       a replica served, past lastEntryId, bytes an add was acknowledged for
gap            an id in 0..lastEntryId could not be read as absent (no entry there)
order          a reader got entries out of id order
failed_present an add the client was told failed is in the ledger
phantom        the ledger holds bytes no add of the history wrote
read_mismatch  an entry a reader got during the run differs from the final ledger, or from
               the bytes acknowledged at its id
dirty_read     a reader got an entry (or was told a LAC) past the final lastEntryId: it saw
               an entry the ledger does not keep
stale_read     every replica of an entry's write set said "no such entry" to a read invoked
               after that entry's add was acknowledged
not_closed     the metadata is not CLOSED after recovery
unreadable     a reader could not read the ledger at all (the check could not be made)
twice          two acknowledged adds of different bytes were given the same id
=============  ==============================================================================

``info`` operations (unknown outcomes), and adds invoked that never completed (their process
was killed: ``unfinished`` in the counts), may be present or absent: no rule names them,
except that their bytes are not phantoms.

Reads during the run (workload.Reader: ``read`` and ``read_lac`` operations) are judged too:
every entry a read returned (a read that ended early: those it got) must be at its id in the
final ledger with the same bytes, bytes some add wrote (else ``phantom``) and, when an add was
acknowledged at that id, its bytes; a closed ledger's end a reader was told must be the final
one (else ``disagree``).

The past-end probe asks every node of the last segment's ensemble itself for the ids after
lastEntryId, past the client's range check. A replica may keep an add the recovery did not
find (it reached too few replicas to be acknowledged: BookKeeper leaves such an entry where it
is and no reader asks for it); such bytes, of an add whose outcome is unknown, are counted
(``leftovers``), not a violation; an acknowledged add's bytes there are ``past_end``, a failed
one's ``failed_present``, anyone else's ``phantom``. A stream's appends that were not
acknowledged have no ledger in the history (no answer named one), so ``check`` takes their
digests as ``unplaced``: past an end such bytes are leftovers too, never in a ledger's range
(there, a stream entry no cursor read is a phantom of the stream's checker).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.client import Client, ClientError
from node.jepsen.history import ABSENT, READS, Op, digest
from node.jepsen.workload import ask_replicas

READERS = 3  # fresh clients that read every ledger back, each from its own node order
PAST_END_PROBES = 2  # ids past lastEntryId a reader asks for (each must be refused)


# Given a ledger's metadata (Client.ledger_metadata), how to take the payload out of one of
# its entries as stored (None: the entry is the payload): a deduplicating stream's header.
Payload = Callable[[Mapping[str, Any]], Callable[[bytes], bytes] | None]


@dataclass
class Observation:
    """What one fresh reader saw of one ledger."""

    reader: str
    state: str = ""  # the metadata's state
    last_entry_id: int | None = None  # None: the reader could not open the ledger
    entries: list[tuple[int, str]] = field(default_factory=list)  # (id, digest) as read, in order
    # (id, node, digest) of what a replica served past lastEntryId
    past_end: list[tuple[int, str, str]] = field(default_factory=list)
    probe_errors: int = 0  # past-end probes answered neither with bytes nor "absent"
    error: str = ""  # why it could not read, when it could not

    @staticmethod
    def of(
        reader: str, state: str, last_entry_id: int, entries: Iterable[tuple[int, bytes]]
    ) -> Observation:
        return Observation(
            reader, state, last_entry_id, [(e, digest(payload)) for e, payload in entries]
        )


@dataclass(frozen=True)
class Violation:
    kind: str
    ledger: int
    entry: int | None
    detail: str

    def __str__(self) -> str:
        where = f"ledger {self.ledger}" + (f" entry {self.entry}" if self.entry is not None else "")
        return f"{self.kind}: {where}: {self.detail}"


@dataclass
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # ok/fail/info operations, ledgers

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "counts": self.counts,
            "violations": [str(v) for v in self.violations],
        }

    def __str__(self) -> str:
        head = "clean" if self.ok else f"{len(self.violations)} violation(s)"
        return "\n".join([f"{head}; {self.counts}", *(f"  {v}" for v in self.violations)])


@dataclass
class _Expected:
    """The history of one ledger."""

    acked: dict[int, str] = field(default_factory=dict)  # id -> digest of ok adds
    failed: set[str] = field(default_factory=set)  # digests of failed adds
    written: set[str] = field(default_factory=set)  # every digest any add carried
    ends: list[tuple[str, int]] = field(default_factory=list)  # ok close/recover: (f, end)
    twice: set[int] = field(default_factory=set)  # ids two ok adds of other bytes were given
    acked_at: dict[int, float] = field(default_factory=dict)  # id -> when its add was ok
    reads: list[tuple[int, str, str]] = field(default_factory=list)  # (id, digest, reader)
    absent: list[tuple[int, float, str]] = field(default_factory=list)  # (id, invoked, reader)
    lacs: list[tuple[int, str]] = field(default_factory=list)  # (LAC told, reader)
    closed_ends: list[tuple[int, str]] = field(default_factory=list)  # (end told, reader)
    unplaced: frozenset[str] = frozenset()  # digests of unacknowledged writes of no ledger


def _expectations(history: Iterable[Op]) -> dict[int, _Expected]:
    ledgers: dict[int, _Expected] = {}
    invoked: dict[str, float] = {}  # a reader's last invoke: it runs one read at a time
    for op in history:
        if op.ledger is None:
            continue
        exp = ledgers.setdefault(op.ledger, _Expected())
        if op.f in ("add", "add_batch"):
            exp.written.update(op.digests())
            if op.type == "ok":
                for entry, d in op.entries():
                    if exp.acked.get(entry, d) != d:
                        exp.twice.add(entry)
                    exp.acked[entry] = d
                    exp.acked_at.setdefault(entry, op.t)
            elif op.type == "fail":
                exp.failed.update(op.digests())
        elif op.type == "ok" and op.f in ("close", "recover") and op.entry is not None:
            exp.ends.append((op.f, op.entry))
        elif op.f in ("read", "read_lac") and op.type == "invoke":
            invoked[op.p] = op.t
        elif op.f == "read" and op.entry is not None:
            # A read that ended early returned these too: each is judged.
            exp.reads.extend((entry, d, op.p) for entry, d in op.entries())
            if op.error == ABSENT:
                missing = op.entry + len(op.digests())
                exp.absent.append((missing, invoked.get(op.p, op.t), op.p))
        elif op.f == "read_lac" and op.type == "ok" and op.entry is not None:
            if op.last is not None:
                exp.closed_ends.append((op.last, op.p))
            else:
                exp.lacs.append((op.entry, op.p))
    return ledgers


def _unfinished(history: Iterable[Op]) -> int:
    """Adds invoked that never completed (their process died first): unknown, like info."""
    open_adds: set[tuple[str, ...]] = set()
    for op in history:
        if op.f in ("add", "add_batch"):
            key = (op.p, *op.digests())
            if op.type == "invoke":
                open_adds.add(key)
            else:
                open_adds.discard(key)
    return len(open_adds)


def check(
    history: Sequence[Op],
    observed: Mapping[int, Sequence[Observation]],
    unplaced: frozenset[str] = frozenset(),
) -> Verdict:
    """Every ledger the history names must have been observed by at least one reader;
    ``unplaced``: digests of writes not acknowledged whose ledger the history cannot name."""
    verdict = Verdict()
    verdict.counts = {**_op_counts(history), "unfinished": _unfinished(history), "ledgers": 0}
    for ledger, exp in sorted(_expectations(history).items()):
        verdict.counts["ledgers"] += 1
        views = list(observed.get(ledger, []))
        if not views:
            verdict.violations.append(Violation("unreadable", ledger, None, "no reader saw it"))
            continue
        exp.unplaced = unplaced
        verdict.violations.extend(_check_ledger(ledger, exp, views))
        for view in views:
            leftovers = sum(_leftover(d, exp) for _, _, d in view.past_end)
            if leftovers:
                verdict.counts["leftovers"] = verdict.counts.get("leftovers", 0) + leftovers
            if view.probe_errors:
                errors = verdict.counts.get("probe_errors", 0) + view.probe_errors
                verdict.counts["probe_errors"] = errors
    return verdict


def _op_counts(history: Iterable[Op]) -> dict[str, int]:
    """Completed writes by outcome (ok, fail, info); completed reads (``reads``), those that
    got everything they asked (``reads_ok``) and the entries reads returned (``read_entries``)."""
    counts: dict[str, int] = {"reads": 0, "reads_ok": 0, "read_entries": 0}
    for op in history:
        if op.type == "invoke":
            continue
        if op.f in READS:
            counts["reads"] += 1
            counts["reads_ok"] += op.type == "ok"
            counts["read_entries"] += len(op.digests())
        else:
            counts[op.type] = counts.get(op.type, 0) + 1
    return counts


def _unknown(d: str, exp: _Expected) -> bool:
    """The bytes of an add whose outcome is unknown (neither acknowledged nor failed)."""
    return d not in exp.failed and d not in exp.acked.values()


def _leftover(d: str, exp: _Expected) -> bool:
    """Bytes a replica may keep past a ledger's end: those of a write of unknown outcome, or
    of a stream's append that was not acknowledged."""
    return d in exp.unplaced or (d in exp.written and _unknown(d, exp))


def _check_ledger(ledger: int, exp: _Expected, views: list[Observation]) -> list[Violation]:
    found: list[Violation] = []

    def bad(kind: str, entry: int | None, detail: str) -> None:
        found.append(Violation(kind, ledger, entry, detail))

    for entry in sorted(exp.twice):
        bad("twice", entry, "two acknowledged adds of different bytes got this id")
    readable = [v for v in views if v.last_entry_id is not None]
    for view in views:
        if view.last_entry_id is None:
            bad("unreadable", None, f"{view.reader}: {view.error}")
    if not readable:
        return found
    ends = {v.last_entry_id for v in readable}
    if len(ends) > 1:
        seen = ", ".join(f"{v.reader}: {v.last_entry_id}" for v in readable)
        bad("disagree", None, f"readers see different lastEntryIds ({seen})")
    last = min(e for e in ends if e is not None)
    for f, end in exp.ends:
        if end != last:
            bad("disagree", None, f"a {f} ended at {end}, readers see {last}")
    for entry, _ in sorted(exp.acked.items()):
        if entry > last:
            bad("short", entry, f"acknowledged, but the ledger ends at {last}")
    _check_reads(exp, last, bad)
    for view in readable:
        _check_view(view, exp, bad)
    return found


def _check_reads(exp: _Expected, last: int, bad: Any) -> None:
    """What readers got during the run against the acknowledged adds and the final end."""
    for entry, got, reader in exp.reads:
        want = exp.acked.get(entry)
        if entry > last:
            bad("dirty_read", entry, f"{reader} read {got}, but the ledger ends at {last}")
        if want is not None and got != want:
            bad("read_mismatch", entry, f"{reader} read {got}, {want} was acknowledged")
        if got not in exp.written:
            bad("phantom", entry, f"{reader} read bytes no add wrote")
    for lac, reader in exp.lacs:
        if lac > last:
            bad("dirty_read", lac, f"{reader} was told LAC {lac}, but the ledger ends at {last}")
    for end, reader in exp.closed_ends:
        if end != last:
            bad("disagree", None, f"{reader} saw the ledger closed at {end}, readers see {last}")
    for entry, invoked, reader in exp.absent:
        acked_at = exp.acked_at.get(entry)
        if acked_at is not None and acked_at < invoked:
            bad("stale_read", entry, f"{reader}: absent from every replica, acknowledged before")


def _check_view(view: Observation, exp: _Expected, bad: Any) -> None:
    name = view.reader
    last = view.last_entry_id
    assert last is not None
    if view.state != "CLOSED":
        bad("not_closed", None, f"{name}: metadata state {view.state!r}")
    for entry, node, served in view.past_end:
        where = f"{name}: {node} served it past lastEntryId {last}"
        if served in exp.failed:
            bad("failed_present", entry, f"{where}, bytes of a failed add")
        elif _leftover(served, exp):
            continue
        elif served not in exp.written:
            bad("phantom", entry, f"{where}, bytes no add wrote")
        else:
            bad("past_end", entry, f"{where}, bytes of an acknowledged add")
    ids = [e for e, _ in view.entries]
    if ids != sorted(ids) or len(set(ids)) != len(ids):
        bad("order", None, f"{name}: read ids {ids[:20]} out of order")
    held = dict(view.entries)
    for entry in range(last + 1):
        if entry not in held:
            bad("gap", entry, f"{name}: no entry at {entry} (lastEntryId {last})")
    for entry, want in exp.acked.items():
        got = held.get(entry)
        if entry <= last and got != want:
            bad("lost", entry, f"{name}: acknowledged {want}, read {got}")
    for entry, want, reader in exp.reads:
        got = held.get(entry)
        if entry <= last and got is not None and got != want:
            bad("read_mismatch", entry, f"{name}: {reader} read {want} during the run, now {got}")
    for entry, got in held.items():
        if got in exp.failed:
            bad("failed_present", entry, f"{name}: bytes of a failed add")
        elif got not in exp.written:
            bad("phantom", entry, f"{name}: bytes no add wrote")


async def observe(
    client: Client, reader: str, ledger_id: int, payload: Payload | None = None
) -> Observation:
    """What ``client`` reads of ``ledger_id``: its metadata's state, lastEntryId, every entry
    up to it and what each node of the last ensemble serves past it (asked directly: the
    client itself refuses ids past the end). Nothing is fenced or recovered. ``payload``:
    given the ledger's metadata, what of each entry's bytes the history's digests are of
    (None: all of them)."""
    try:
        meta = await client.ledger_metadata(ledger_id)
        handle = await client.open_ledger(ledger_id)
        last = handle.last_entry_id
        entries = [(e, data) async for e, data in handle.read(0, last)]
    except ClientError as error:
        return Observation(reader, error=f"{type(error).__name__}: {error}")
    of = None if payload is None else payload(meta)
    if of is not None:
        entries = [(e, of(data)) for e, data in entries]
    seen = Observation.of(reader, meta["state"], last, entries)
    nodes = list(handle.metadata.last_segment.ensemble)
    for entry in range(last + 1, last + 1 + PAST_END_PROBES):
        for node, answer in (await ask_replicas(client, ledger_id, entry, nodes)).items():
            if isinstance(answer, bytes):
                seen.past_end.append((entry, node, digest(answer if of is None else of(answer))))
            elif not answer.absent:
                seen.probe_errors += 1
    return seen


async def check_cluster(
    history: Sequence[Op],
    metadata_url: str,
    readers: int = READERS,
    address_override: Mapping[str, str] | None = None,
    unplaced: frozenset[str] = frozenset(),
    payload: Payload | None = None,
) -> Verdict:
    """Reads every ledger of ``history`` with ``readers`` fresh clients, each trying replicas
    in its own seeded order, and checks what they saw against the history (``unplaced``: as
    ``check`` takes it; ``payload``: as ``observe`` takes it)."""
    ledgers = sorted({op.ledger for op in history if op.ledger is not None})
    observed: dict[int, list[Observation]] = {lid: [] for lid in ledgers}
    for i in range(readers):
        async with Client(
            metadata_url, address_override=address_override, rng=random.Random(i)
        ) as client:
            for lid in ledgers:
                observed[lid].append(await observe(client, f"reader{i}", lid, payload))
    return check(history, observed, unplaced)
