"""What a ledger's handles (writer.py, reader.py) and its recovery (recovery.py) need of the
``Client`` that made them (client.py): the metadata store, the nodes and the transport to
them, the limits and timeouts, and the spawning of the client's background requests.

``Client`` is the one ``Session``; the handles take the protocol, not the class, so that
client.py imports them and they never import client.py back."""

from __future__ import annotations

import asyncio
import random
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from node.client.bookies import Transport
from node.client.metadata.store import MetadataStore
from node.client.registry import Registry

T = TypeVar("T")


class Session(Protocol):
    store: MetadataStore
    registry: Registry
    transport: Transport
    rng: random.Random
    home_node: str | None  # this process's own node, asked first (a local replica's reads, adds)
    add_timeout_s: float
    read_timeout_s: float
    speculative_read_s: float
    recovery_timeout_s: float
    recovery_read_window: int
    max_ensemble_changes: int
    read_range_entries: int
    read_ahead_ranges: int
    max_entry_size: int
    max_request_bytes: int
    max_request_entries: int
    adds_in_flight_per_node: int
    unsafe_unfenced_recovery_reads: bool
    closed: bool
    _handles: weakref.WeakSet[Any]  # the open writers, settled by the client's close

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A background request of the client, cancelled by its close."""
        ...
