"""What the replicas check expects of each node (node/audit/fleet.py, plain Python), and how
it judges copies that disagree (node/audit/checks.py, on small hand-made tables in Spark):
the cases a three-node cluster does not reach cheaply (segments after an ensemble change, a
node without a snapshot, an open ledger's tail, two copies that tie)."""

from __future__ import annotations

from typing import Any

import pytest

from node.audit import checks, fleet
from node.client.model import LedgerMetadata, LedgerState, Segment

LID = 2**62 + 7
SNAPSHOTS = {"snap-a": "a", "snap-b": "b", "snap-c": "c"}


def _ledger(
    segments: list[tuple[int, tuple[str, ...]]], *, closed_at: int | None, qw: int = 3
) -> LedgerMetadata:
    closed = closed_at is not None
    return LedgerMetadata(
        ledger_id=LID,
        ensemble_size=3,
        write_quorum=qw,
        ack_quorum=2,
        segments=tuple(Segment(first, ensemble) for first, ensemble in segments),
        state=LedgerState.CLOSED if closed else LedgerState.OPEN,
        last_entry_id=closed_at if closed_at is not None else -1,
        length=0,
        closed_ms=1 if closed else None,
    )


def _ranges(plan: fleet.Plan) -> set[tuple[str, int, int]]:
    return {(r.node_id, r.first, r.last) for r in plan.ranges}


def test_a_closed_ledger_is_checked_segment_by_segment_on_the_nodes_with_a_snapshot() -> None:
    meta = _ledger([(0, ("a", "b", "c")), (5, ("a", "b", "d"))], closed_at=9)
    plan = fleet.expected_ranges({name: [meta] for name in SNAPSHOTS}, SNAPSHOTS, {})
    assert _ranges(plan) == {("a", 0, 4), ("b", 0, 4), ("c", 0, 4), ("a", 5, 9), ("b", 5, 9)}
    assert plan.nodes_without_snapshot == {"d"}  # d's copies are not checked: said so
    assert plan.ledgers == 3 and plan.open_tail_skipped == 0


def test_an_open_ledger_stops_at_the_lowest_writer_lac_of_its_last_ensemble() -> None:
    meta = _ledger([(0, ("a", "b", "c")), (4, ("a", "b", "c"))], closed_at=None)
    lacs = {("a", LID): 9, ("b", LID): 7, ("c", LID): 8}
    plan = fleet.expected_ranges({name: [meta] for name in SNAPSHOTS}, SNAPSHOTS, lacs)
    # The first segment in full (sealed by the ensemble change), the last up to 7.
    assert _ranges(plan) == {(n, 0, 3) for n in "abc"} | {(n, 4, 7) for n in "abc"}
    assert plan.open_tail_skipped == 3
    # A replica that holds nothing of the ledger (no writer LAC): the tail is not checked.
    del lacs[("c", LID)]
    plan = fleet.expected_ranges({name: [meta] for name in SNAPSHOTS}, SNAPSHOTS, lacs)
    assert _ranges(plan) == {(n, 0, 3) for n in "abc"}


def test_a_node_is_held_to_the_metadata_read_before_its_own_snapshot() -> None:
    """a's snapshot came while the ledger was open (writer LAC 2 everywhere), b's after it
    closed at 5: a is checked to 2, b to 5."""
    open_meta = _ledger([(0, ("a", "b", "c"))], closed_at=None)
    closed_meta = _ledger([(0, ("a", "b", "c"))], closed_at=5)
    lacs = {(n, LID): 2 for n in "abc"}
    plan = fleet.expected_ranges({"snap-a": [open_meta], "snap-b": [closed_meta]}, SNAPSHOTS, lacs)
    assert _ranges(plan) == {("a", 0, 2), ("b", 0, 5)}


def test_a_ledgers_file_round_trips_and_a_bad_one_is_refused() -> None:
    meta = _ledger([(0, ("a", "b", "c"))], closed_at=3)
    doc = {"version": 1, "takenMs": 1, "ledgers": [meta.to_json()], "unreadable": []}
    assert fleet.parse(doc, "doc") == [meta]
    with pytest.raises(fleet.FleetError):
        fleet.parse({**doc, "version": 2}, "doc")
    with pytest.raises(fleet.FleetError):
        fleet.parse({**doc, "ledgers": [{**meta.to_json(), "writeQuorumSize": 9}]}, "doc")


def _inputs(spark: Any, copies: dict[str, tuple[int, bool]], qw: int) -> checks.Inputs:
    """Entry 0 of ledger LID; ``copies``: node id -> (its copy's CRC, CRC ok)."""
    records = spark.createDataFrame(
        [(f"snap-{n}", 1, 1024, LID, 0, 100, ok, crc) for n, (crc, ok) in copies.items()],
        "node string, log_id long, offset long, ledger_id long, entry_id long, size long, "
        "crc_ok boolean, crc long",
    )
    locations = records.select("node", "ledger_id", "entry_id", "log_id", "offset")
    ledgers = spark.createDataFrame(
        [(f"snap-{n}", LID, "OPEN") for n in copies], "node string, ledger_id long, state string"
    )
    expected = spark.createDataFrame(
        [(f"snap-{n}", n, LID, 0, 0, ["a", "b", "c"], 3, qw) for n in "abc"],
        checks.EXPECTED_SCHEMA,
    )
    tables = {"locations": locations, "ledgers": ledgers}
    return checks.Inputs(spark, records, tables, [], 0, 0, expected)


def _found(spark: Any, copies: dict[str, tuple[int, bool]], qw: int = 3) -> dict[str, str]:
    rows = checks.check_replicas(_inputs(spark, copies, qw)).collect()
    return {r["node_id"]: f"{r['kind']}: {r['what']}" for r in rows}


def test_the_odd_copy_out_is_named_and_a_tie_names_every_copy(spark: Any) -> None:
    assert _found(spark, {"a": (7, True), "b": (7, True), "c": (7, True)}) == {}
    odd = _found(spark, {"a": (7, True), "b": (7, True), "c": (9, True)})
    assert list(odd) == ["c"] and "2 of 3 copies have CRC32C 00000007" in odd["c"]
    # A copy failing its own check loses to good ones even when they are fewer.
    bad = _found(spark, {"a": (5, False), "b": (5, False), "c": (7, True)})
    assert set(bad) == {"a", "b"} and "fails its own check" in bad["a"]
    missing = _found(spark, {"a": (7, True), "b": (7, True)})
    assert list(missing) == ["c"] and missing["c"].startswith("missing: missing: node c")
    # Qw 2 of 3: entry 0 belongs to a and b only; they disagree with no majority.
    tie = _found(spark, {"a": (7, True), "b": (9, True)}, qw=2)
    assert set(tie) == {"a", "b"} and all("no majority" in w for w in tie.values())
