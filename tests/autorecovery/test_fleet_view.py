"""The fleet view's states and dependents from given store contents (node.autorecovery.fleet's
``build``, pure): what a real fleet shows for a killed node is tests/status/test_fleet.py's;
here the states a three-node test cannot reach cheaply (lost past the delay, audited lost,
decommissioning, read-only, named by ledgers only) and striped ensembles."""

from __future__ import annotations

from node.autorecovery import fleet
from node.client.model import LedgerMetadata, LedgerState, NodeInfo, NodeState, Segment
from node.storage.index import STREAM_PROPERTY

NOW_MS = 1_000_000_000
DELAY_S = 600.0
LISTED = 2


def ledger(
    ledger_id: int,
    *ensembles: tuple[str, ...],
    state: LedgerState = LedgerState.OPEN,
    quorums: tuple[int, int] = (3, 2),
    stream: str | None = None,
) -> LedgerMetadata:
    closed = state is LedgerState.CLOSED
    return LedgerMetadata(
        ledger_id=ledger_id,
        ensemble_size=len(ensembles[0]),
        write_quorum=quorums[0],
        ack_quorum=quorums[1],
        segments=tuple(Segment(i * 10, e) for i, e in enumerate(ensembles)),
        state=state,
        last_entry_id=len(ensembles) * 10 - 1 if closed else -1,
        closed_ms=NOW_MS if closed else None,
        properties={STREAM_PROPERTY: stream} if stream else {},
    )


def registered(node_id: str, read_only: bool = False) -> NodeInfo:
    state = NodeState.READONLY if read_only else NodeState.WRITABLE
    return NodeInfo(node_id, f"http://{node_id}", zone="z", state=state)


def test_the_stream_property_is_the_engine_s() -> None:
    assert fleet.STREAM_PROPERTY == STREAM_PROPERTY


def test_each_state_and_when_a_node_counts_as_lost() -> None:
    view = fleet.build(
        NOW_MS,
        DELAY_S,
        registered=[registered("a"), registered("b", read_only=True), registered("c")],
        cookies=["a", "b", "c", "d", "e", "f"],
        since={"d": NOW_MS - 1000, "e": NOW_MS - 601_000, "f": NOW_MS - 5},
        decommissioning=["c"],
        reported_lost=["f", "g"],
        ledgers=[],
        listed=LISTED,
    )
    states = {n.node_id: n.state for n in view.nodes}
    assert states == {
        "a": "registered",
        "b": "read_only",
        "c": "decommissioning",
        "d": "unregistered",  # within the delay
        "e": "lost",  # past it
        "f": "lost",  # the last audit said so (its delay may be shorter than this node's)
        "g": "lost",  # audited lost, its cookie since retired: still named
    }
    d = next(n for n in view.nodes if n.node_id == "d")
    assert (d.unregistered_since_ms, d.lost_at_ms) == (NOW_MS - 1000, NOW_MS - 1000 + 600_000)
    assert not d.registered and d.cookie and d.url is None


def test_open_ledgers_name_their_last_ensemble_and_count_what_is_reachable() -> None:
    view = fleet.build(
        NOW_MS,
        DELAY_S,
        registered=[registered(n) for n in ("a", "b", "c", "e")],
        cookies=["a", "b", "c", "d", "e"],
        since={"d": NOW_MS},
        decommissioning=[],
        reported_lost=[],
        ledgers=[
            # d was replaced by e: the open ledger's writer no longer needs d, its copies do.
            ledger(1, ("a", "b", "d"), ("a", "b", "e"), stream="s1"),
            ledger(2, ("a", "d", "c"), stream="s2"),
            ledger(3, ("a", "b", "c", "d"), quorums=(2, 2)),  # striped: 4 nodes, 2 copies
            ledger(4, ("a", "d", "c")),
            ledger(5, ("a", "b", "d"), state=LedgerState.CLOSED),
            ledger(6, ("a", "b", "c"), state=LedgerState.IN_RECOVERY, stream="s1"),
        ],
        listed=LISTED,
    )
    nodes = {n.node_id: n for n in view.nodes}
    d = nodes["d"]
    assert d.ledgers == 5 and d.open_ledger_count == 3
    assert [x.ledger_id for x in d.open_ledgers] == [2, 3]  # the first LISTED, in id order
    assert d.streams == ["s2"]
    assert (d.open_ledgers[0].reachable, d.open_ledgers[0].ensemble_size) == (2, 3)
    striped = d.open_ledgers[1]
    assert (striped.reachable, striped.ensemble_size, striped.write_quorum) == (3, 4, 2)
    assert nodes["a"].streams == ["s1", "s2"] and nodes["a"].open_ledger_count == 5
    assert nodes["e"].open_ledger_count == 1 and nodes["e"].ledgers == 1
    # At risk: every ledger a segment of which names d, closed or not; 6 names only live nodes.
    assert (view.ledgers, view.at_risk_ledgers, view.at_risk_open_ledgers) == (6, 5, 4)


def test_a_node_named_only_by_a_ledger_is_listed_and_never_counted_lost() -> None:
    """No cookie (retired by ``shell readd``, or a value another writer left): the auditor never
    marks it lost, so neither does the view; its ledgers are at risk all the same."""
    view = fleet.build(
        NOW_MS,
        DELAY_S,
        registered=[registered("a"), registered("b")],
        cookies=["a", "b"],
        since={},
        decommissioning=[],
        reported_lost=[],
        ledgers=[ledger(7, ("a", "b", "x"))],
        listed=LISTED,
    )
    x = next(n for n in view.nodes if n.node_id == "x")
    assert (x.state, x.cookie, x.lost_at_ms, x.open_ledger_count) == (
        "unregistered",
        False,
        None,
        1,
    )
    assert view.at_risk_ledgers == 1
