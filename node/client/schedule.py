"""Where entries go and when enough replicas have answered (BookKeeper's
RoundRobinDistributionSchedule and RRQuorumCoverageSet).

Entry e is held by the Qw consecutive members of its segment's ensemble from index e mod E. A
question put to a whole ensemble (a recovery's LAC read) is answered for the ledger once, in every
one of the E write quorums, fewer than Qa members are unknown: then no entry can have reached Qa
acknowledgements on members that did not answer."""

from __future__ import annotations


def write_indexes(entry_id: int, ensemble: int, write_quorum: int) -> list[int]:
    """Indexes into the ensemble of the Qw nodes that hold ``entry_id``."""
    return [(entry_id + i) % ensemble for i in range(write_quorum)]


class CoverageSet:
    """Answers of an ensemble's members, each known (a value, or a definite "not here") or not
    yet/unknown; ``covered`` once every write quorum has fewer than Qa unknown members."""

    def __init__(self, ensemble: int, write_quorum: int, ack_quorum: int) -> None:
        self.ensemble, self.write_quorum, self.ack_quorum = ensemble, write_quorum, ack_quorum
        self.known: set[int] = set()

    def add(self, index: int) -> None:
        self.known.add(index)

    def covered(self) -> bool:
        for start in range(self.ensemble):
            unknown = sum(
                1
                for index in write_indexes(start, self.ensemble, self.write_quorum)
                if index not in self.known
            )
            if unknown >= self.ack_quorum:
                return False
        return True
