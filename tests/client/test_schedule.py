"""Write sets and quorum coverage, checked exhaustively for every ensemble up to 6 nodes
against the definition: covered exactly when no Qa members of one write quorum are unknown, that
is, when no entry could have been acknowledged by members that did not answer."""

from __future__ import annotations

from itertools import combinations

from node.client.schedule import CoverageSet, write_indexes

SHAPES = [(e, qw, qa) for e in range(1, 7) for qw in range(1, e + 1) for qa in range(1, qw + 1)]


def test_write_sets_are_consecutive_from_entry_mod_ensemble() -> None:
    for e, qw, _ in SHAPES:
        for entry_id in range(3 * e):
            indexes = write_indexes(entry_id, e, qw)
            assert indexes == [(entry_id % e + i) % e for i in range(qw)]
            assert len(set(indexes)) == qw
        # Striping spreads entries evenly: each index is in exactly Qw of the E write sets.
        counts = [sum(i in write_indexes(x, e, qw) for x in range(e)) for i in range(e)]
        assert counts == [qw] * e


def could_hide_an_acknowledged_entry(e: int, qw: int, qa: int, known: set[int]) -> bool:
    """Some entry's write set has Qa members that did not answer."""
    return any(len(set(write_indexes(entry_id, e, qw)) - known) >= qa for entry_id in range(e))


def test_coverage_is_exactly_the_definition_for_every_answer_set() -> None:
    checked = 0
    for e, qw, qa in SHAPES:
        for size in range(e + 1):
            for known in combinations(range(e), size):
                coverage = CoverageSet(e, qw, qa)
                for index in known:
                    coverage.add(index)
                assert coverage.covered() is not could_hide_an_acknowledged_entry(
                    e, qw, qa, set(known)
                ), (e, qw, qa, known)
                checked += 1
    assert checked > 1000


def test_coverage_of_three_three_two_needs_any_two() -> None:
    coverage = CoverageSet(3, 3, 2)
    coverage.add(0)
    assert not coverage.covered()
    coverage.add(2)
    assert coverage.covered()
