"""The WAL headers' identity field as it is on disk: the instance id each journal file's
header carries, or the raw-device ring's newest valid header. The WAL writes the id its owner
gives (journal.py, blockwal.py: ``instance_id``); the node's cookie check
(node/replication/cookie.py) reads them here and refuses a WAL of another instance."""

from __future__ import annotations

import uuid

from node.settings import Settings
from node.storage import journalformat, ringformat


def wal_instances(settings: Settings) -> list[tuple[str, str]]:
    """(file, instance id) of every WAL header that carries one: each journal file's, or
    the raw-device WAL's newest valid header slot."""
    if settings.wal_kind == "blockdev":
        return _ring_instance(settings)
    found = []
    for journal_id in journalformat.list_journals(settings.journal_dir):
        path = journalformat.journal_path(settings.journal_dir, journal_id)
        with path.open("rb") as f:
            head = f.read(journalformat.HEADER_SIZE)
        if len(head) < journalformat.HEADER_SIZE or not any(head):
            continue  # a crash while it was created: replay's to judge
        try:
            instance = journalformat.header_instance_id(head)
        except ValueError:
            continue  # replay refuses a bad header with its own message
        if instance is not None:
            found.append((str(path), str(uuid.UUID(bytes=instance))))
    return found


def _ring_instance(settings: Settings) -> list[tuple[str, str]]:
    path = settings.wal_path
    if path is None or not path.exists():
        return []
    with path.open("rb") as f:
        slots = f.read(ringformat.HEADER_AREA)
    headers = []
    for slot in range(ringformat.HEADER_SLOTS):
        start = slot * ringformat.HEADER_SLOT_SIZE
        try:
            headers.append(
                ringformat.decode_header(slots[start : start + ringformat.HEADER_SLOT_SIZE])
            )
        except ValueError:
            continue  # the WAL's open judges a bad slot
    if not headers:
        return []
    newest = max(headers, key=lambda header: header.sequence)
    if newest.instance_id == ringformat.NO_INSTANCE:
        return []
    return [(str(path), str(uuid.UUID(bytes=newest.instance_id)))]
