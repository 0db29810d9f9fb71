"""The replicas check (BookKeeper's AuditorReplicasCheckTask, but reading the entries): every
entry of every fragment is read from each replica of its write set, directly, and the CRC32C of
the bytes compared. A replica that says the entry is not there, or whose bytes differ from what
the most replicas hold, is a finding: the auditor marks that node of the ledger with the reason
"replicas", and a worker moves the fragment to another node; or, when the node's findings are
all entries it lacks, "missing", and a worker copies them onto it (ledgercheck.py finds those
cheaply, from the replicas' indexes).

Only what is settled is checked: every entry of a CLOSED ledger, and the segments of an OPEN
one before its last (the writer may still be adding to the last; entries past its LAC are on
fewer than Qw nodes by design). An answer that is neither the entry nor "not here" (a timeout,
a refused connection, an unregistered node) is no finding: the node is down, which the lost-node
rule handles, or slow, which proves nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crc32c import crc32c

from node.client.bookies import within
from node.client.errors import ReplicaError
from node.client.model import LedgerMetadata

if TYPE_CHECKING:
    from node.client.client import Client

MISSING = "missing"
DIFFERENT = "different"
CORRUPT_RECORD = "corrupt_record"  # the node's code for bytes whose stored CRC fails
# Entries whose replica reads are in flight at once (each costs Qw requests).
READ_WINDOW = 16


@dataclass(frozen=True)
class Finding:
    ledger_id: int
    entry_id: int
    node: str
    kind: str  # MISSING or DIFFERENT


def entry_range(meta: LedgerMetadata, index: int) -> range:
    """The entry ids of segment ``index`` that are settled: up to the next segment's first, or
    the ledger's end when CLOSED; the last segment of a ledger not CLOSED: none."""
    segments = meta.segments
    first = segments[index].first_entry_id
    if index + 1 < len(segments):
        return range(first, segments[index + 1].first_entry_id)
    if meta.closed:
        return range(first, meta.last_entry_id + 1)
    return range(first, first)


def fragment_entries(meta: LedgerMetadata, index: int, node: str) -> Iterator[int]:
    """The entries of segment ``index`` whose write set holds ``node`` (the fragment)."""
    for entry_id in entry_range(meta, index):
        if node in meta.write_set(entry_id):
            yield entry_id


async def _read(client: Client, node: str, ledger_id: int, entry_id: int) -> int | str | None:
    """The CRC32C of the node's copy; MISSING or DIFFERENT (a stored CRC that fails) as the
    node said; None when it did not answer either way."""
    try:
        payload = await within(
            node,
            client.transport.read_entry(node, ledger_id, entry_id, fence=False),
            client.read_timeout_s,
        )
    except ReplicaError as error:
        if error.absent:
            return MISSING
        if error.code == CORRUPT_RECORD:
            return DIFFERENT
        return None
    return crc32c(payload)


async def _check_entry(
    client: Client, meta: LedgerMetadata, entry_id: int, skip: Collection[str]
) -> list[Finding]:
    nodes = [n for n in meta.write_set(entry_id) if n not in skip]
    answers = await asyncio.gather(*(_read(client, n, meta.ledger_id, entry_id) for n in nodes))
    crcs = Counter(a for a in answers if isinstance(a, int))
    findings = []
    # The bytes most replicas hold are the entry's; a tie between two versions condemns both.
    best = crcs.most_common(1)[0][1] if crcs else 0
    winners = {crc for crc, count in crcs.items() if count == best} if crcs else set()
    agreed = next(iter(winners)) if len(winners) == 1 else None
    for node, answer in zip(nodes, answers, strict=True):
        if answer == MISSING:
            findings.append(Finding(meta.ledger_id, entry_id, node, MISSING))
        elif answer == DIFFERENT or (isinstance(answer, int) and answer != agreed):
            findings.append(Finding(meta.ledger_id, entry_id, node, DIFFERENT))
    return findings


async def check_ledger(
    client: Client, meta: LedgerMetadata, skip: Collection[str] = ()
) -> tuple[list[Finding], int]:
    """The findings on ``meta``'s settled entries and how many entries were read; nodes in
    ``skip`` (lost or decommissioning: marked already) are not asked."""
    entry_ids = [e for i in range(len(meta.segments)) for e in entry_range(meta, i)]
    findings: list[Finding] = []
    for start in range(0, len(entry_ids), READ_WINDOW):
        chunk = entry_ids[start : start + READ_WINDOW]
        for found in await asyncio.gather(*(_check_entry(client, meta, e, skip) for e in chunk)):
            findings.extend(found)
    return findings, len(entry_ids)
