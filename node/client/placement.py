"""Which nodes hold a ledger: distinct nodes, spread over as many zones as the registered
writable nodes allow. Pure functions of (candidates, current ensemble, random source)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Sequence

from node.client.errors import NotEnoughNodes
from node.client.model import NodeInfo, NodeState


def _eligible(candidates: Sequence[NodeInfo], exclude: Collection[str]) -> list[NodeInfo]:
    seen: set[str] = set()
    chosen = []
    for node in candidates:
        eligible = node.state is NodeState.WRITABLE and node.node_id not in exclude
        if eligible and node.node_id not in seen:
            seen.add(node.node_id)
            chosen.append(node)
    return chosen


def _pick(pool: list[NodeInfo], zone_counts: Counter[str], rng: random.Random) -> NodeInfo:
    """A node of the least represented zone (ties broken at random)."""
    zones = sorted({n.zone for n in pool})
    rng.shuffle(zones)
    best = min(zones, key=lambda z: zone_counts[z])
    return rng.choice([n for n in pool if n.zone == best])


def choose_ensemble(
    candidates: Sequence[NodeInfo],
    size: int,
    rng: random.Random,
    exclude: Collection[str] = (),
    home: str | None = None,
) -> list[str]:
    """``size`` distinct writable nodes, one per zone while zones last, then cycling zones.
    ``home`` (the writer's own node) comes first when it is eligible, as HDFS puts a block's
    first replica on the writer's node: its copy is written and read without the network.
    NotEnoughNodes when fewer than ``size`` are eligible."""
    pool = _eligible(candidates, exclude)
    if len(pool) < size:
        raise NotEnoughNodes(
            f"an ensemble of {size} needs {size} writable registered nodes, "
            f"{len(pool)} are available ({sorted(n.node_id for n in pool)})"
        )
    zone_counts: Counter[str] = Counter()
    chosen: list[str] = []
    while len(chosen) < size:
        local = [n for n in pool if n.node_id == home] if not chosen else []
        node = local[0] if local else _pick(pool, zone_counts, rng)
        pool.remove(node)
        zone_counts[node.zone] += 1
        chosen.append(node.node_id)
    return chosen


def choose_replacement(
    candidates: Sequence[NodeInfo],
    ensemble: Sequence[str],
    failed: str,
    rng: random.Random,
    exclude: Collection[str] = (),
) -> str:
    """A writable node for ``failed``'s place: not in the ensemble, not excluded, in a zone the
    rest of the ensemble does not use when there is one, else the least represented."""
    zone_of = {n.node_id: n.zone for n in candidates}
    pool = _eligible(candidates, set(ensemble) | set(exclude) | {failed})
    if not pool:
        raise NotEnoughNodes(
            f"no writable registered node can replace {failed} in {list(ensemble)}"
        )
    zone_counts = Counter(zone_of.get(n, "") for n in ensemble if n != failed)
    return _pick(pool, zone_counts, rng).node_id
