"""The stripe arithmetic of the ledger check against brute force: the ids a node of an
ensemble holds (LedgerMetadata.write_set's rule), their count, and what a replica lacks of
them, cut at a limit of ranges."""

from __future__ import annotations

import random

import pytest

from node.client.model import LedgerMetadata, LedgerState, Segment
from node.client.stripes import IdRange, Stripe, shortfall


def _ranges(ids: list[int]) -> list[IdRange]:
    found: list[IdRange] = []
    for entry_id in ids:
        if found and found[-1][1] + 1 == entry_id:
            found[-1] = (found[-1][0], entry_id)
        else:
            found.append((entry_id, entry_id))
    return found


@pytest.mark.parametrize("ensemble_size", [1, 2, 3, 5])
def test_stripes_agree_with_the_write_sets(ensemble_size: int) -> None:
    rng = random.Random(ensemble_size)
    nodes = tuple(f"n{i}" for i in range(ensemble_size))
    for quorum in range(1, ensemble_size + 1):
        meta = LedgerMetadata(
            ledger_id=1,
            ensemble_size=ensemble_size,
            write_quorum=quorum,
            ack_quorum=1,
            segments=(Segment(0, nodes),),
            state=LedgerState.CLOSED,
            last_entry_id=99,
            length=100,
        )
        for position, node in enumerate(nodes):
            stripe = Stripe(ensemble_size, quorum, position)
            for _ in range(50):
                first = rng.randint(0, 40)
                last = rng.randint(first - 1, 99)
                expected = [e for e in range(first, last + 1) if node in meta.write_set(e)]
                assert [e for lo, hi in stripe.ranges(first, last) for e in range(lo, hi + 1)] == (
                    expected
                )
                assert stripe.count(first, last) == len(expected)
                held = sorted(set(rng.sample(range(100), rng.randint(0, 80))))
                limit = rng.randint(1, 5)
                found = shortfall(stripe, _ranges(held), first, last, limit)
                lacked = [e for e in expected if e not in held]
                assert len(found.missing) <= limit
                assert found.missing == _ranges([e for e in lacked if e <= found.covered])
                if found.covered < last:  # cut at the limit, just before the next missing id
                    assert len(found.missing) == limit
                    assert min(e for e in lacked if e > found.covered) == found.covered + 1
                assert found.held == sum(1 for e in expected if e in held and e <= found.covered)


def test_a_stripe_outside_its_ensemble_is_refused() -> None:
    for shape in ((3, 4, 0), (3, 0, 0), (3, 2, 3), (3, 2, -1)):
        with pytest.raises(ValueError):
            Stripe(*shape)
