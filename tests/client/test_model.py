"""The ledger metadata codec: round trips, and every invariant refused on decode."""

from __future__ import annotations

import json

import pytest

from node.client import model
from node.client.protocol import decode_range, encode_range, parse_replication_header


def _meta(**changes: object) -> model.LedgerMetadata:
    base = model.LedgerMetadata(
        ledger_id=2**62 + 7,
        ensemble_size=3,
        write_quorum=2,
        ack_quorum=2,
        segments=(model.Segment(0, ("n0", "n1", "n2")),),
        ctime_ms=1,
        properties={"purpose": "test"},
    )
    return base.evolve(**changes) if changes else base


def test_round_trip_and_bookkeeper_names() -> None:
    meta = _meta(
        state=model.LedgerState.CLOSED,
        last_entry_id=11,
        length=99,
        segments=(model.Segment(0, ("n0", "n1", "n2")), model.Segment(5, ("n0", "n3", "n2"))),
    )
    data = model.encode(meta)
    assert model.decode(data) == meta
    raw = json.loads(data)
    assert raw["formatVersion"] == 1
    assert raw["segments"][1] == {"firstEntryId": 5, "ensemble": ["n0", "n3", "n2"]}
    assert {"ensembleSize", "writeQuorumSize", "ackQuorumSize", "lastEntryId", "length"} <= set(raw)


def test_striping_follows_the_entry_segment() -> None:
    meta = _meta(segments=(model.Segment(0, ("a", "b", "c")), model.Segment(4, ("a", "d", "c"))))
    assert [meta.write_set(e) for e in range(4)] == [["a", "b"], ["b", "c"], ["c", "a"], ["a", "b"]]
    assert meta.write_set(4) == ["d", "c"]
    assert meta.write_set(5) == ["c", "a"]


@pytest.mark.parametrize(
    "changes",
    [
        {"ack_quorum": 3},
        {"write_quorum": 4, "ack_quorum": 1},
        {"segments": ()},
        {"segments": (model.Segment(0, ("n0", "n0", "n1")),)},
        {"segments": (model.Segment(0, ("n0", "n1")),)},
        {"segments": (model.Segment(1, ("n0", "n1", "n2")),)},
        {"segments": (model.Segment(0, ("n0", "n1", "n2")), model.Segment(0, ("n3", "n1", "n2")))},
        {"last_entry_id": 4},
        {"state": model.LedgerState.CLOSED, "last_entry_id": -2},
        {
            "state": model.LedgerState.CLOSED,
            "last_entry_id": 2,
            "segments": (
                model.Segment(0, ("n0", "n1", "n2")),
                model.Segment(9, ("n3", "n1", "n2")),
            ),
        },
    ],
)
def test_invariants_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(model.MetadataFormatError):
        _meta(**changes)


@pytest.mark.parametrize(
    "data", [b"", b"[]", b'{"formatVersion": 2}', b'{"formatVersion": 1, "ledgerId": 1}']
)
def test_bad_values_are_refused(data: bytes) -> None:
    with pytest.raises(model.MetadataFormatError):
        model.decode(data)


def test_node_registration_round_trip() -> None:
    info = model.NodeInfo("n1", "http://127.0.0.1:1", "z1", model.NodeState.READONLY, "i", 5)
    assert model.NodeInfo.decode(info.encode()) == info
    with pytest.raises(model.MetadataFormatError):
        model.NodeInfo.decode(b"{}")


def test_wire_helpers() -> None:
    entries = [(3, b"abc"), (9, b""), (12, b"x" * 70000)]
    assert list(decode_range(encode_range(entries))) == entries
    with pytest.raises(ValueError):
        list(decode_range(encode_range(entries)[:-1]))
    assert parse_replication_header("3/3/2") == (3, 3, 2)
    for bad in ("3/2", "2/3/1", "3/3/0", "a/b/c"):
        with pytest.raises(ValueError):
            parse_replication_header(bad)
