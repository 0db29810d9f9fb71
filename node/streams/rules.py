"""The stream rules, each in one place and pure (a stream's record, its cursors' marks and
the time in; a decision out), so that the node, its status page and the Spark audit cannot
disagree:

- which ledgers retention deletes (``plan_deletions``, after ``retention_mark``: the slowest
  cursor, moved by the message TTL as the run moves it);
- where the message TTL moves cursors (``ttl_mark``);
- which ledgers offload sends to the object store (``offload_candidates``), and when the
  local copy of an offloaded ledger goes (``offload_deletion_lag_ms``, ``local_copy_due_ms``);
- why a closed ledger of a stream is still kept (``why_kept``), which the status page shows.

Retention (README "Streams"): among the closed ledgers before the slowest cursor's
mark-delete position (all closed ledgers when the stream has no cursor), in ascending order,
delete a ledger if it closed longer ago than the retention time, or if what remains after
deleting it is still at least the retention size; stop at the first ledger that satisfies
retention. Backlog is never deleted, the ledger taking appends never, and only a prefix of
the stream ever. Forced (a data disk past ``disk_space_clean_forcibly_ratio``), the time and
size are ignored for acknowledged data (still never for backlog). With a message TTL, each
run first moves every cursor past the closed ledgers that closed longer ago than the TTL
(ledger granularity: entries carry no time of their own).

Imports: the standard library and the stream model only. The audit's Spark workers import
this module, and must not pull in the engine (storage, lifecycle, HTTP).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

from node.settings import MiB
from node.streams.model import MINUTE_MS, Cursor, LedgerInfo, Position, Stream

MS_PER_S = 1000

DeletionReason = Literal["time", "size", "disk"]
KeptReason = Literal["cursor_backlog", "message_ttl", "offload_deletion_lag", "retention"]


@dataclass(slots=True)
class Deletion:
    stream: str
    ledger_id: int
    reason: DeletionReason
    size_bytes: int

    def to_json(self) -> dict[str, object]:
        return {"ledgerId": self.ledger_id, "reason": self.reason, "bytes": self.size_bytes}


@dataclass(frozen=True, slots=True)
class Kept:
    """Why retention keeps a closed ledger of a stream, in words for the operator."""

    reason: KeptReason
    detail: str
    cursor: str | None = None  # the cursor that holds it (backlog, TTL)
    due: bool = False  # the next retention run deletes it


class OffloadRecord(Protocol):
    """What the rules read of a ledger's offload record (``node.storage.index.OffloadInfo``)."""

    @property
    def offloaded(self) -> bool: ...

    @property
    def offloaded_ms(self) -> int: ...

    @property
    def local_deleted(self) -> bool: ...


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / MS_PER_S, UTC).strftime("%Y-%m-%d %H:%M UTC")


# --- cursors and the message TTL ---------------------------------------------------------


def acknowledged(info: LedgerInfo, mark: Position) -> bool:
    """Whether a cursor whose mark-delete is ``mark`` has consumed all of the ledger."""
    return info.ledger_id < mark.ledger_id or (
        info.ledger_id == mark.ledger_id and mark.entry_id >= info.entries - 1
    )


def ttl_mark(stream: Stream, now_ms: int) -> Position | None:
    """Where the message TTL moves every cursor at ``now_ms`` (never back): the last entry
    of the last closed ledger that closed longer ago than the TTL. None: no TTL, or no
    ledger that old. The ledger taking appends never expires."""
    ttl_s = stream.policies.messageTtlInSeconds
    if ttl_s <= 0:
        return None
    before_ms = now_ms - ttl_s * MS_PER_S
    expired = [i for i in stream.ledgers[:-1] if i.closed_ms and i.closed_ms < before_ms]
    return Position(expired[-1].ledger_id, expired[-1].entries - 1) if expired else None


def retention_mark(stream: Stream, marks: Iterable[Position], now_ms: int) -> Position | None:
    """The position retention deletes up to: the slowest cursor's mark-delete, after the
    message TTL moved the cursors. None: the stream has no cursor."""
    slowest = min(marks, default=None)
    expired = ttl_mark(stream, now_ms)
    if slowest is None or expired is None:
        return slowest
    return max(slowest, expired)


# --- retention -----------------------------------------------------------------------------


def _time_passed(stream: Stream, info: LedgerInfo, now_ms: int) -> bool:
    """Closed longer ago than the retention time (strictly: Pulsar's ``>``)."""
    limit = stream.policies.retentionTimeInMinutes
    return limit >= 0 and now_ms - info.closed_ms > limit * MINUTE_MS


def plan_deletions(
    stream: Stream, slowest: Position | None, now_ms: int, forced: bool
) -> list[Deletion]:
    """The closed ledgers before ``slowest`` (``retention_mark``; None: no cursor) that
    retention deletes at ``now_ms``, oldest first."""
    closed = stream.ledgers[:-1]  # never the ledger taking appends
    if slowest is not None:
        closed = [info for info in closed if acknowledged(info, slowest)]
    size_limit = stream.policies.retentionSizeInMB
    total = sum(info.size_bytes for info in stream.ledgers)
    deleting = 0
    plan = []
    for info in closed:  # a prefix of the stream: ledger ids ascend
        deleting += info.size_bytes
        if forced:
            plan.append(Deletion(stream.name, info.ledger_id, "disk", info.size_bytes))
            continue
        expired = _time_passed(stream, info, now_ms)
        over = size_limit >= 0 and total - deleting >= size_limit * MiB
        if not (expired or over):
            break
        plan.append(
            Deletion(stream.name, info.ledger_id, "time" if expired else "size", info.size_bytes)
        )
    return plan


# --- offload ---------------------------------------------------------------------------


def offload_candidates(stream: Stream, now_ms: int) -> list[int]:
    """Ledgers the stream's policies send to the object store, oldest first (offloaded
    ones included), by Pulsar's maybeOffload: its ledgers newest first, summing their bytes;
    a closed one is chosen when the sum passes ``offloadThresholdInBytes`` or when it closed
    at least ``offloadThresholdInSeconds`` ago."""
    by_bytes = stream.policies.offloadThresholdInBytes
    by_age = stream.policies.offloadThresholdInSeconds
    if by_bytes < 0 and by_age < 0:
        return []
    summed = 0
    chosen = []
    for info in reversed(stream.ledgers):
        summed += info.size_bytes
        if not info.closed_ms:
            continue  # the ledger taking appends
        over = by_bytes >= 0 and summed > by_bytes
        old = by_age >= 0 and now_ms - info.closed_ms >= by_age * MS_PER_S
        if over or old:
            chosen.append(info.ledger_id)
    return sorted(chosen)


def offload_deletion_lag_ms(owner: Stream | None, plain_lag_ms: int) -> int:
    """How long an offloaded ledger keeps its local copy: its stream's
    ``offloadDeletionLagInMillis``; ``plain_lag_ms`` (the node's setting) for a ledger of no
    stream (or of one deleted since)."""
    return owner.policies.offloadDeletionLagInMillis if owner is not None else plain_lag_ms


def local_copy_due_ms(offload: OffloadRecord | None, lag_ms: int) -> int | None:
    """When an offloaded ledger's local copy goes; None: no local copy waits on the lag
    (not offloaded, or already dropped)."""
    if offload is None or not offload.offloaded or offload.local_deleted:
        return None
    return offload.offloaded_ms + lag_ms


def local_copy_kept(offload: OffloadRecord | None, lag_ms: int) -> Kept | None:
    """The offload deletion lag, if it is what keeps the ledger's local copy."""
    due = local_copy_due_ms(offload, lag_ms)
    if due is None:
        return None
    return Kept(
        "offload_deletion_lag",
        f"offloaded; the local copy goes after the deletion lag ({_iso(due)})",
    )


# --- why a ledger is kept ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetentionView:
    """A stream as a retention run at ``now_ms`` would see it (``retention_view``): worked
    out once per stream, then asked about each of its ledgers (``why_kept``)."""

    stream: Stream
    cursors: Sequence[Cursor]
    now_ms: int
    mark: Position | None  # retention_mark: what the run deletes up to
    deletions: dict[int, Deletion]  # by ledger id: what the run deletes
    ledgers: dict[int, LedgerInfo]  # by ledger id: every ledger the stream names
    held_bytes: int  # the stream's bytes


def retention_view(stream: Stream, cursors: Sequence[Cursor], now_ms: int) -> RetentionView:
    mark = retention_mark(stream, [c.mark_delete for c in cursors], now_ms)
    plan = plan_deletions(stream, mark, now_ms, forced=False)
    return RetentionView(
        stream,
        cursors,
        now_ms,
        mark,
        {d.ledger_id: d for d in plan},
        {info.ledger_id: info for info in stream.ledgers},
        sum(info.size_bytes for info in stream.ledgers),
    )


def why_kept(view: RetentionView, ledger_id: int, offload: OffloadRecord | None) -> Kept | None:
    """Why a closed ledger of the stream is still there, the most actionable reason first:
    a cursor behind it (unless the message TTL moves that cursor past it at the next run),
    retention due to delete it at the next run, the offload deletion lag (of its local copy),
    or the retention policy keeping it. None: the stream does not name the ledger (its rules
    do not apply). Reads ``plan_deletions`` as a run now would, so the two cannot disagree."""
    stream, info = view.stream, view.ledgers.get(ledger_id)
    if info is None:
        return None
    deletion = view.deletions.get(ledger_id)
    behind = [c for c in view.cursors if not acknowledged(info, c.mark_delete)]
    if behind:
        slowest = min(behind, key=lambda c: c.mark_delete)
        held = (
            f"cursor {slowest.name} has not acknowledged it (mark-delete at "
            f"{stream.shown_mark(slowest.mark_delete)})"
        )
        if view.mark is None or not acknowledged(info, view.mark):
            return Kept("cursor_backlog", held + _ttl_note(stream, info), slowest.name)
        then = " and deletes it" if deletion else "; then " + _kept_detail(view, info)
        return Kept(
            "message_ttl",
            f"{held}, but it closed more than the message TTL "
            f"({stream.policies.messageTtlInSeconds} s) ago: the next retention run moves the "
            f"cursor past it{then}",
            slowest.name,
            due=deletion is not None,
        )
    if deletion is not None:
        return Kept("retention", "acknowledged; " + _due_detail(view, deletion), due=True)
    lagging = local_copy_kept(offload, stream.policies.offloadDeletionLagInMillis)
    if lagging is not None:
        return lagging
    return Kept("retention", "acknowledged; " + _kept_detail(view, info))


def _ttl_note(stream: Stream, info: LedgerInfo) -> str:
    ttl_s = stream.policies.messageTtlInSeconds
    if ttl_s <= 0 or not info.closed_ms or info is stream.ledgers[-1]:
        return ""  # the ledger taking appends never expires
    expires = _iso(info.closed_ms + ttl_s * MS_PER_S)
    return f"; the message TTL ({ttl_s} s) moves the cursor past it after {expires}"


def _due_detail(view: RetentionView, deletion: Deletion) -> str:
    policies = view.stream.policies
    if deletion.reason == "time":
        why = f"retention time ({policies.retentionTimeInMinutes} min) passed"
    else:
        why = (
            f"past the retention size ({policies.retentionSizeInMB} MB; the stream holds "
            f"{view.held_bytes / MiB:.1f})"
        )
    return why + ": the next retention run deletes it"


def _kept_detail(view: RetentionView, info: LedgerInfo) -> str:
    """What of the retention policy keeps an acknowledged ledger retention does not delete."""
    stream, policies = view.stream, view.stream.policies
    time_limit, size_limit = policies.retentionTimeInMinutes, policies.retentionSizeInMB
    if info is stream.ledgers[-1]:
        return "the stream's newest ledger: retention never deletes it"
    if time_limit < 0 and size_limit < 0:
        return "the stream's retention keeps data forever (-1)"
    parts = []
    if _time_passed(stream, info, view.now_ms):  # yet not deleted: an older ledger stops the run
        parts.append(
            f"retention time ({time_limit} min) passed, but an older ledger is kept "
            "(retention deletes only from the oldest)"
        )
    elif time_limit >= 0:
        due = info.closed_ms + time_limit * MINUTE_MS
        parts.append(f"retention time ({time_limit} min) not yet due: {_iso(due)}")
    if size_limit >= 0:
        parts.append(
            f"retention size keeps {size_limit} MB (the stream holds {view.held_bytes / MiB:.1f})"
        )
    return "; ".join(parts)
