"""The pure stream rules (node/streams/rules.py) and the policy table (node/streams/policies.py):

- what the status page says keeps a ledger agrees with what retention deletes, on any
  stream, cursors, message TTL, limits and time (hypothesis): a backlog is never deleted,
  the TTL is named only where it is what releases a ledger, and "the next run deletes it"
  exactly for the ledgers a run now would delete;
- the message TTL is named as the reason, with the cursor it moves, and the time it will;
- the offload deletion lag of a stream's ledger is its stream's;
- the policies' defaults are the settings', and the HTTP API lists the same policies.

The engine-level behaviour (retention runs on real storage) is in test_stream_rules.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import get_type_hints

from hypothesis import given, settings
from hypothesis import strategies as st

from node.http import models
from node.offload.offloader import ineligible_reason
from node.storage.index import OffloadInfo, OffloadState
from node.streams import rules
from node.streams.model import MINUTE_MS, Cursor, LedgerInfo, Position, Stream
from node.streams.policies import POLICIES, Policies, default_policies
from tests.harness.settings import make_settings

NOW_MS = 1_800_000_000_000
HOUR_MS = 60 * MINUTE_MS


@dataclass(frozen=True, slots=True)
class Offloaded:
    """An offload record as the rules read it (node.storage.index.OffloadInfo's fields)."""

    offloaded_ms: int
    offloaded: bool = True
    local_deleted: bool = False


@st.composite
def streams(draw: st.DrawFn) -> tuple[Stream, list[Cursor]]:
    """A stream of 1-6 ledgers (the last takes appends), closed at ascending times in the
    last few hours, with a few cursors anywhere in it (or before it), any retention and TTL."""
    count = draw(st.integers(1, 6))
    first_id = draw(st.integers(0, 5))
    closed = sorted(draw(st.lists(st.integers(0, 6 * 60), min_size=count, max_size=count)))
    ledgers = [
        LedgerInfo(
            first_id + k,
            draw(st.integers(0, 4)),
            draw(st.integers(0, 3)) * 1024 * 1024,
            NOW_MS - 7 * HOUR_MS,
            NOW_MS - (6 * 60 - minutes) * MINUTE_MS if k < count - 1 else 0,
        )
        for k, minutes in enumerate(closed)
    ]
    policies = Policies(
        retentionTimeInMinutes=draw(st.sampled_from([-1, 0, 30, 120, 600])),
        retentionSizeInMB=draw(st.sampled_from([-1, 0, 1, 3, 8])),
        messageTtlInSeconds=draw(st.sampled_from([0, 60, 3600, 4 * 3600])),
    )
    stream = Stream("s", policies, NOW_MS - 7 * HOUR_MS, ledgers)
    marks = st.builds(
        Position,
        st.integers(max(0, first_id - 1), first_id + count),
        st.integers(-1, 4),
    )
    cursors = [
        Cursor("s", f"c{n}", mark, NOW_MS - 7 * HOUR_MS)
        for n, mark in enumerate(draw(st.lists(marks, max_size=3)))
    ]
    return stream, cursors


def _ids(plan: list[rules.Deletion]) -> set[int]:
    return {d.ledger_id for d in plan}


@settings(max_examples=400)
@given(case=streams(), offloaded=st.booleans())
def test_why_a_ledger_is_kept_agrees_with_what_retention_deletes(
    case: tuple[Stream, list[Cursor]], offloaded: bool
) -> None:
    stream, cursors = case
    raw = min((c.mark_delete for c in cursors), default=None)
    after_ttl = rules.retention_mark(stream, [c.mark_delete for c in cursors], NOW_MS)
    deleted = _ids(rules.plan_deletions(stream, after_ttl, NOW_MS, forced=False))
    # Forced (a full disk): every ledger the cursors acknowledged goes, whatever the limits.
    acknowledged = _ids(rules.plan_deletions(stream, raw, NOW_MS, forced=True))
    released = _ids(rules.plan_deletions(stream, after_ttl, NOW_MS, forced=True))
    offload = Offloaded(NOW_MS - MINUTE_MS) if offloaded else None
    view = rules.retention_view(stream, cursors, NOW_MS)
    for info in stream.ledgers:
        kept = rules.why_kept(view, info.ledger_id, offload)
        assert kept is not None
        lid = info.ledger_id
        assert kept.due == (lid in deleted), kept
        if kept.reason == "cursor_backlog":  # not even a full disk deletes a backlog
            assert lid not in released and kept.cursor is not None
        elif kept.reason == "message_ttl":  # the TTL, and only it, releases the ledger
            assert lid not in acknowledged and lid in released and kept.cursor is not None
        elif kept.reason == "retention":
            assert lid in acknowledged or info is stream.ledgers[-1], kept
        else:
            assert kept.reason == "offload_deletion_lag" and offloaded and not kept.due
    assert rules.why_kept(view, stream.ledgers[-1].ledger_id + 1, None) is None


def kept_now(
    stream: Stream, ledger_id: int, cursors: list[Cursor], offload: Offloaded | None
) -> rules.Kept | None:
    return rules.why_kept(rules.retention_view(stream, cursors, NOW_MS), ledger_id, offload)


def orders(ttl_s: int, retention_minutes: int = 60) -> Stream:
    """Three ledgers, closed 3 h and 2 h ago; the third takes appends."""
    policies = Policies(retentionTimeInMinutes=retention_minutes, messageTtlInSeconds=ttl_s)
    return Stream(
        "orders",
        policies,
        NOW_MS - 4 * HOUR_MS,
        [
            LedgerInfo(1, 10, 1000, NOW_MS - 4 * HOUR_MS, NOW_MS - 3 * HOUR_MS),
            LedgerInfo(2, 10, 1000, NOW_MS - 3 * HOUR_MS, NOW_MS - 2 * HOUR_MS),
            LedgerInfo(3, 4, 400, NOW_MS - 2 * HOUR_MS, 0),
        ],
    )


def test_the_message_ttl_is_named_where_it_releases_a_ledger_a_cursor_holds() -> None:
    lagging = [Cursor("orders", "lagging", Position(1, 3), NOW_MS - 4 * HOUR_MS)]
    # TTL 150 min: the first ledger (closed 3 h ago) expired, the second (2 h) not yet.
    stream = orders(ttl_s=150 * 60)
    first = kept_now(stream, 1, lagging, None)
    assert first is not None and (first.reason, first.cursor, first.due) == (
        "message_ttl",
        "lagging",
        True,
    )
    assert "message TTL (9000 s)" in first.detail and first.detail.endswith("deletes it")
    second = kept_now(stream, 2, lagging, None)
    assert second is not None and (second.reason, second.cursor) == ("cursor_backlog", "lagging")
    assert "moves the cursor past it after 2027-01-15 08:30 UTC" in second.detail
    # Retention 4 h: released by the TTL, yet kept by the retention time after the run.
    kept = kept_now(orders(ttl_s=150 * 60, retention_minutes=240), 1, lagging, None)
    assert kept is not None and kept.reason == "message_ttl" and not kept.due
    assert "then retention time (240 min) not yet due" in kept.detail
    # Without a TTL the cursor holds both.
    for lid in (1, 2):
        held = kept_now(orders(ttl_s=0), lid, lagging, None)
        assert held is not None and held.reason == "cursor_backlog" and "TTL" not in held.detail


def test_an_offloaded_stream_ledger_keeps_its_local_copy_for_its_streams_lag() -> None:
    stream = orders(ttl_s=0, retention_minutes=-1)
    stream.policies.offloadDeletionLagInMillis = HOUR_MS
    offload = Offloaded(NOW_MS - 10 * MINUTE_MS)
    kept = kept_now(stream, 1, [], offload)
    assert kept is not None and kept.reason == "offload_deletion_lag"
    assert "(2027-01-15 08:50 UTC)" in kept.detail  # offloaded 10 min ago + 1 h
    lag = rules.offload_deletion_lag_ms(stream, plain_lag_ms=5)
    assert rules.local_copy_due_ms(offload, lag) == NOW_MS + 50 * MINUTE_MS
    assert rules.offload_deletion_lag_ms(None, plain_lag_ms=5) == 5
    assert rules.local_copy_due_ms(Offloaded(NOW_MS, local_deleted=True), lag) is None
    assert rules.local_copy_due_ms(None, lag) is None


def test_the_policies_defaults_are_the_settings_and_the_api_lists_every_policy(
    tmp_path: Path,
) -> None:
    node = make_settings(
        tmp_path, managed_ledger_max_entries_per_ledger=7, default_retention_size_in_mb=3
    )
    defaults = default_policies(node)
    assert (defaults.maxEntriesPerLedger, defaults.retentionSizeInMB) == (7, 3)
    assert defaults.messageTtlInSeconds == 0  # no setting: none
    # A PUT's body: every policy, and the stream's replication (not a policy: no setting of
    # a node without a metadata store changes it)
    assert list(get_type_hints(models.StreamPolicies)) == [*POLICIES, "replication"]
    assert list(models.PolicyValues.model_fields) == list(POLICIES)


def test_a_stream_record_keeps_its_ledgers_offload_records_and_reads_older_records() -> None:
    """A replicated stream's ledger carries its offload record and its ``closing`` mark
    through encode and decode; a record written before offload records existed (no
    "offload" key) still decodes."""
    offloaded = OffloadInfo(OffloadState.OFFLOADED, "a" * 32, 1234, NOW_MS, local_deleted=True)
    in_progress = OffloadInfo(OffloadState.IN_PROGRESS, "b" * 32)
    stream = Stream(
        "s",
        default_policies(make_settings(Path("/nonexistent"))),
        NOW_MS,
        [
            LedgerInfo(1, 10, 100, NOW_MS, NOW_MS, offloaded),
            LedgerInfo(2, 10, 100, NOW_MS, NOW_MS, in_progress),
            LedgerInfo(3, 1, 10, NOW_MS),
        ],
    )
    decoded = Stream.decode(stream.encode())
    assert [info.offload for info in decoded.ledgers] == [offloaded, in_progress, None]
    assert decoded.ledgers[0].meta("s").offload == offloaded
    # A ledger rolled over from whose close is not confirmed is no closed ledger to offload
    # yet: its count may be short of what was acknowledged in it.
    closing = LedgerInfo(4, 10, 100, NOW_MS, NOW_MS, closing=True)
    assert Stream.decode(dataclasses.replace(stream, ledgers=[closing]).encode()).ledgers == [
        closing
    ]
    assert ineligible_reason(closing.meta("s")) == "not_closed"
    assert ineligible_reason(dataclasses.replace(closing, closing=False).meta("s")) is None
    old = stream.encode().replace(b', "offload": {', b', "x": {')
    assert [info.offload for info in Stream.decode(old).ledgers] == [None, None, None]
