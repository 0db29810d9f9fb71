"""Which ids of a segment a replica holds by its write sets, as ranges: the node at
``position`` of an ensemble of E, with write quorum Qw, holds id e when (position - e) mod E
< Qw (``LedgerMetadata.write_set``: Qw consecutive nodes from e mod E). So it holds Qw
consecutive ids out of every E (all of them when Qw = E), and a fragment of a million ids
is a rule and two numbers, not a million ids: the ledger check (node/autorecovery) sends the
rule, the replica answers the ranges it lacks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

IdRange = tuple[int, int]  # first and last id, both included


@dataclass(frozen=True)
class Stripe:
    """The ids that the node at ``position`` holds in an ensemble of ``ensemble_size`` with
    write quorum ``write_quorum``."""

    ensemble_size: int
    write_quorum: int
    position: int

    def __post_init__(self) -> None:
        if not 1 <= self.write_quorum <= self.ensemble_size:
            raise ValueError(f"write quorum {self.write_quorum} of an ensemble of {self}")
        if not 0 <= self.position < self.ensemble_size:
            raise ValueError(f"position {self.position} outside an ensemble of {self}")

    @property
    def _start(self) -> int:
        """The residue mod E at which each group of Qw held ids starts."""
        return (self.position - self.write_quorum + 1) % self.ensemble_size

    def ranges(self, first: int, last: int) -> Iterator[IdRange]:
        """The held ids in [first, last] as ranges, ascending."""
        if first > last:
            return
        size, quorum = self.ensemble_size, self.write_quorum
        if quorum == size:
            yield first, last
            return
        group = first - (first - self._start) % size  # the last group start at or before
        while group <= last:
            low, high = max(group, first), min(group + quorum - 1, last)
            if low <= high:
                yield low, high
            group += size

    def count(self, first: int, last: int) -> int:
        """How many ids of [first, last] are held."""
        if first > last:
            return 0
        return self._below(last + 1) - self._below(first)

    def _below(self, end: int) -> int:
        """Held ids below ``end``, counted from a group start (so only differences mean
        anything); floor division makes one formula hold for any ``end``."""
        size, quorum = self.ensemble_size, self.write_quorum
        shifted = end - self._start
        return (shifted // size) * quorum + min(shifted % size, quorum)


@dataclass(frozen=True)
class Shortfall:
    """What a replica lacks of [first, last]: ``missing`` ranges (at most the limit asked),
    ``covered`` the last id they account for (``last``, or before the next missing range
    that did not fit), ``held`` the stripe's ids in [first, covered] that are there."""

    missing: list[IdRange]
    covered: int
    held: int

    @property
    def missing_entries(self) -> int:
        return sum(high - low + 1 for low, high in self.missing)


def shortfall(
    stripe: Stripe, held: Sequence[IdRange], first: int, last: int, limit: int
) -> Shortfall:
    """The ranges of ``stripe``'s ids in [first, last] outside ``held`` (ascending, merged
    ranges), ``limit`` of them at most: the work stops at the first one past the limit, so
    a wiped replica of a striped fragment costs ``limit`` steps, not one per id."""
    missing: list[IdRange] = []
    covered = last
    for low, high in (r for gap in _gaps(held, first, last) for r in stripe.ranges(*gap)):
        if len(missing) == limit:
            covered = low - 1
            break
        missing.append((low, high))
    count = stripe.count(first, covered) - sum(high - low + 1 for low, high in missing)
    return Shortfall(missing, covered, count)


def _gaps(held: Sequence[IdRange], first: int, last: int) -> Iterator[IdRange]:
    """The ids of [first, last] outside ``held`` (ascending, merged), as ranges."""
    at = first
    for low, high in held:
        if high < at:
            continue
        if low > last:
            break
        if low > at:
            yield at, low - 1
        at = high + 1
        if at > last:
            return
    if at <= last:
        yield at, last
