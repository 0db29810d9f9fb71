"""The faults of a fault run, each with its healing: a node SIGKILLed (restarted) or paused
(SIGSTOP, then SIGCONT), a network fault between a writer and a node (a partition, a delay, its
acknowledgements held), etcd killed (restarted), a writer SIGKILLed (never healed: its ledger
is left to recovery).

``Nemesis.random_fault`` picks one by a seeded RNG; ``heal_all`` puts the cluster back whatever
happened (a fault run always ends there, before recovery and the checker)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from node.jepsen.proxy import Direction, ProxyMesh
from node.jepsen.workload import ChildWriter
from node.localcluster import LocalCluster

DELAY_MIN_S = 0.05  # a delayed link's added latency, at least ...
DELAY_MAX_S = 0.5  # ... and at most

Step = Callable[[], Awaitable[None]]


@dataclass
class Fault:
    kind: str  # one of Nemesis.kinds
    name: str  # what it did, for the report: "kill n2", "partition w0-n1"
    apply: Step
    heal: Step


async def _nothing() -> None:
    pass


class Nemesis:
    def __init__(
        self,
        cluster: LocalCluster,
        mesh: ProxyMesh,
        writers: Sequence[ChildWriter],
        rng: random.Random,
    ) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.writers = list(writers)
        self.rng = rng
        self.kinds: dict[str, Callable[[], Fault]] = {
            "kill": self.kill_node,
            "pause": self.pause_node,
            "partition": self.partition,
            "delay": self.delay,
            "hold_acks": self.hold_acks,
            "etcd": self.restart_etcd,
            "writer_kill": self.kill_writer,
        }

    def random_fault(self) -> Fault:
        return self.kinds[self.rng.choice(sorted(self.kinds))]()

    def _node(self) -> str:
        return self.rng.choice(self.cluster.node_ids)

    def _link(self) -> tuple[str, str]:
        return self.rng.choice(self.writers).config.process, self._node()

    def kill_node(self) -> Fault:
        node = self._node()

        async def apply() -> None:
            await asyncio.to_thread(self.cluster.kill, node)

        async def heal() -> None:
            await asyncio.to_thread(self.cluster.start, node)

        return Fault("kill", f"kill {node}", apply, heal)

    def pause_node(self) -> Fault:
        node = self._node()

        async def apply() -> None:
            self.cluster.stop(node)

        async def heal() -> None:
            self.cluster.cont(node)

        return Fault("pause", f"pause {node}", apply, heal)

    def partition(self) -> Fault:
        writer, node = self._link()
        proxy = self.mesh[writer, node]

        async def apply() -> None:
            proxy.drop()

        async def heal() -> None:
            proxy.heal()

        return Fault("partition", f"partition {writer}-{node}", apply, heal)

    def delay(self) -> Fault:
        writer, node = self._link()
        proxy = self.mesh[writer, node]
        seconds = round(self.rng.uniform(DELAY_MIN_S, DELAY_MAX_S), 3)
        direction = self.rng.choice([None, Direction.UP, Direction.DOWN])

        async def apply() -> None:
            proxy.delay(seconds, direction)

        async def heal() -> None:
            proxy.heal()

        name = f"delay {writer}-{node} {seconds}s {direction or 'both'}"
        return Fault("delay", name, apply, heal)

    def hold_acks(self) -> Fault:
        """The node stores the writer's adds; the writer does not hear of it until healed."""
        writer, node = self._link()
        proxy = self.mesh[writer, node]

        async def apply() -> None:
            proxy.hold(Direction.DOWN)

        async def heal() -> None:
            proxy.release()

        return Fault("hold_acks", f"hold acks {node}->{writer}", apply, heal)

    def restart_etcd(self) -> Fault:
        async def apply() -> None:
            await asyncio.to_thread(self.cluster.kill_etcd)

        async def heal() -> None:
            await asyncio.to_thread(self.cluster.restart_etcd)

        return Fault("etcd", "etcd down", apply, heal)

    def kill_writer(self) -> Fault:
        writer = self.rng.choice(self.writers)

        async def apply() -> None:
            await writer.kill()

        return Fault("writer_kill", f"kill writer {writer.config.process}", apply, _nothing)

    async def heal_all(self) -> None:
        """Every node running and answering, etcd up, every link passing."""
        self.mesh.heal()
        if self.cluster.etcd.proc is None or self.cluster.etcd.proc.poll() is not None:
            await asyncio.to_thread(self.cluster.restart_etcd)
        for node_id in self.cluster.node_ids:
            self.cluster.cont(node_id)
            if not self.cluster.node(node_id).alive():
                await asyncio.to_thread(self.cluster.start, node_id)
