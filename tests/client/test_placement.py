"""Placement's properties over random registrations (hypothesis): distinct writable nodes,
as many zones as the nodes allow, NotEnoughNodes only when there are too few; replacements
leave the ensemble and prefer a zone it does not use."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.client.errors import NotEnoughNodes
from node.client.model import NodeInfo, NodeState
from node.client.placement import choose_ensemble, choose_replacement

nodes_strategy = st.lists(
    st.builds(
        NodeInfo,
        node_id=st.sampled_from([f"n{i}" for i in range(12)]),
        url=st.just("http://x"),
        zone=st.sampled_from(["", "a", "b", "c", "d"]),
        state=st.sampled_from([NodeState.WRITABLE, NodeState.WRITABLE, NodeState.READONLY]),
    ),
    max_size=14,
    unique_by=lambda n: n.node_id,
)


@settings(max_examples=300, deadline=None)
@given(
    nodes_strategy,
    st.integers(1, 6),
    st.integers(0, 2**32),
    st.sampled_from([None, *(f"n{i}" for i in range(12))]),
)
def test_ensembles_are_distinct_writable_nodes_spread_over_zones(
    nodes: list[NodeInfo], size: int, seed: int, home: str | None
) -> None:
    """With a home node: it comes first whenever it is writable, and the rest still spread."""
    writable = [n for n in nodes if n.state is NodeState.WRITABLE]
    if len(writable) < size:
        with pytest.raises(NotEnoughNodes):
            choose_ensemble(nodes, size, random.Random(seed), home=home)
        return
    chosen = choose_ensemble(nodes, size, random.Random(seed), home=home)
    assert len(chosen) == size == len(set(chosen))
    assert set(chosen) <= {n.node_id for n in writable}
    zone = {n.node_id: n.zone for n in nodes}
    zones_available = len({n.zone for n in writable})
    assert len({zone[n] for n in chosen}) == min(size, zones_available)
    assert (chosen[0] == home) == (home in {n.node_id for n in writable})


@settings(max_examples=300, deadline=None)
@given(nodes_strategy, st.integers(1, 5), st.integers(0, 2**32))
def test_a_replacement_leaves_the_ensemble_and_prefers_a_new_zone(
    nodes: list[NodeInfo], size: int, seed: int
) -> None:
    rng = random.Random(seed)
    try:
        ensemble = choose_ensemble(nodes, size, rng)
    except NotEnoughNodes:
        return
    failed = ensemble[rng.randrange(size)]
    zone = {n.node_id: n.zone for n in nodes}
    spare = [n for n in nodes if n.state is NodeState.WRITABLE and n.node_id not in ensemble]
    if not spare:
        with pytest.raises(NotEnoughNodes):
            choose_replacement(nodes, ensemble, failed, rng)
        return
    chosen = choose_replacement(nodes, ensemble, failed, rng)
    assert chosen in {n.node_id for n in spare}
    kept_zones = {zone[n] for n in ensemble if n != failed}
    if any(n.zone not in kept_zones for n in spare):
        assert zone[chosen] not in kept_zones


def test_placement_uses_three_zones_of_three() -> None:
    nodes = [NodeInfo(f"n{i}", "http://x", zone="abc"[i % 3]) for i in range(9)]
    for seed in range(20):
        chosen = choose_ensemble(nodes, 3, random.Random(seed))
        assert sorted(n.zone for n in nodes if n.node_id in chosen) == ["a", "b", "c"]
