"""The registered nodes (``nodes/<id>`` in the metadata store, each under its node's lease):
for placement (who is writable, in which zone) and to find a node's URL by its id. A ledger
names nodes by id, never by address, so a node that moves is found again here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from node.client.errors import ClientError
from node.client.metadata.store import MetadataStore
from node.client.model import (
    DECOMMISSIONING_PREFIX,
    NODES_PREFIX,
    MetadataFormatError,
    NodeInfo,
    NodeState,
)


class UnknownNode(ClientError):
    """A node id that is not registered (stopped, or its lease expired) and not overridden."""


class Registry:
    def __init__(
        self, store: MetadataStore, address_override: Mapping[str, str] | None = None
    ) -> None:
        """``address_override``: node id -> base URL used instead of the registered one (tests
        route a node through a proxy so)."""
        self._store = store
        self._override = dict(address_override or {})
        self._urls: dict[str, str] = {}

    async def nodes(self) -> list[NodeInfo]:
        """Every registered node now (a fresh read; values that do not decode are skipped)."""
        found = []
        for _key, versioned in await self._store.range(NODES_PREFIX):
            try:
                found.append(NodeInfo.decode(versioned.value))
            except MetadataFormatError:
                continue
        self._urls = {n.node_id: n.url.rstrip("/") for n in found}
        return found

    async def candidates(self) -> list[NodeInfo]:
        """The registered nodes as placement sees them: one being decommissioned counts as
        read-only, so that no new ensemble, ensemble change or re-replication chooses it
        while its fragments move away (it still serves reads)."""
        leaving = {
            key.removeprefix(DECOMMISSIONING_PREFIX)
            for key, _v in await self._store.range(DECOMMISSIONING_PREFIX)
        }
        return [
            replace(n, state=NodeState.READONLY) if n.node_id in leaving else n
            for n in await self.nodes()
        ]

    def registered(self, node_id: str) -> bool:
        """Whether ``node_id`` was registered at the last read of ``nodes`` (no read here)."""
        return node_id in self._urls

    async def url(self, node_id: str) -> str:
        """The base URL of ``node_id``: the override, else its registration (re-read on a miss)."""
        if node_id in self._override:
            return self._override[node_id].rstrip("/")
        if node_id not in self._urls:
            await self.nodes()
        try:
            return self._urls[node_id]
        except KeyError:
            raise UnknownNode(f"node {node_id} is not registered") from None

    def known_url(self, node_id: str) -> str | None:
        """``url`` without a read: None when it would have to read the registrations."""
        if node_id in self._override:
            return self._override[node_id].rstrip("/")
        return self._urls.get(node_id)

    def forget(self, node_id: str) -> None:
        """Drop a cached URL after a connection failure: the next call re-reads the registration."""
        self._urls.pop(node_id, None)
