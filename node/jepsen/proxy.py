"""A TCP proxy in front of one node for one client: the faults of the network between them.

A client reaches node ``n1`` through its own proxy (``Client(address_override={"n1":
proxy.url})``), so a test can cut, slow or hold the traffic of one (client, node) pair while
every other pair flows. Each direction has a rule, switchable at any time:

=========  ===================================================================================
pass       bytes flow
delay S    each chunk is delivered S seconds after it arrived (order kept)
hold       chunks wait, in order, until the rule changes (``release``): a request that reached
           nobody yet, or an answer the client has not seen
drop       chunks are read and thrown away (a partition); a connection that lost bytes is
           reset when the rule changes, since its byte stream has a hole, or (``heal(
           keep_cut=True)``) stays cut for good while new connections pass: its request is
           never answered and never retried
reset      every open connection is reset (RST) and new ones are reset at once
=========  ===================================================================================

``up`` is client -> node, ``down`` node -> client. The proxy lives in the event loop that
started it; its methods are called from that loop's thread (they never block).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field
from enum import StrEnum

CHUNK = 65536  # bytes read at a time
HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ")  # a chunk that starts a request
REQUEST_LINE_MAX = 200  # bytes of a request line kept for a test to look at


class Direction(StrEnum):
    UP = "up"  # client -> node
    DOWN = "down"  # node -> client


class Action(StrEnum):
    PASS = "pass"
    DELAY = "delay"
    HOLD = "hold"
    DROP = "drop"
    RESET = "reset"


@dataclass(frozen=True)
class Rule:
    action: Action = Action.PASS
    delay_s: float = 0.0

    @staticmethod
    def delay(seconds: float) -> Rule:
        return Rule(Action.DELAY, seconds)


PASS = Rule()
HOLD = Rule(Action.HOLD)
DROP = Rule(Action.DROP)
RESET = Rule(Action.RESET)


@dataclass
class Counters:
    connections: int = 0  # accepted from the client
    resets: int = 0  # connections the proxy reset
    received: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    delivered: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    dropped: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    requests: list[str] = field(default_factory=list)  # request lines seen going up


def _abort(writer: asyncio.StreamWriter) -> None:
    """Closes with RST rather than FIN: the peer sees "connection reset"."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Pipe:
    """One connection: client <-> proxy <-> node, a reader and a deliverer per direction."""

    def __init__(
        self,
        proxy: Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        node: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.node = node
        self.lost_bytes = False
        self.cut = False  # for good: whatever comes is dropped, the connection stays open
        self.tasks: list[asyncio.Task[None]] = []
        for direction, (src, dst) in {
            Direction.UP: (client[0], node[1]),
            Direction.DOWN: (node[0], client[1]),
        }.items():
            queue: asyncio.Queue[tuple[float, Rule, bytes]] = asyncio.Queue()
            self.tasks.append(asyncio.create_task(self._read(direction, src, queue)))
            self.tasks.append(asyncio.create_task(self._deliver(direction, dst, queue)))

    async def _read(
        self,
        direction: Direction,
        src: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, Rule, bytes]],
    ) -> None:
        loop = asyncio.get_running_loop()
        counters = self.proxy.counters
        try:
            while data := await src.read(CHUNK):
                counters.received[direction] += len(data)
                if direction is Direction.UP and data.startswith(HTTP_METHODS):
                    line = data.split(b"\r\n", 1)[0][:REQUEST_LINE_MAX]
                    counters.requests.append(line.decode("latin-1"))
                    self.proxy._on_request(line)
                rule = self.proxy.rules[direction]
                if rule.action is Action.DROP or self.cut:
                    counters.dropped[direction] += len(data)
                    self.lost_bytes = True
                    continue
                queue.put_nowait((loop.time() + rule.delay_s, rule, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, PASS, b""))  # end of stream

    async def _deliver(
        self,
        direction: Direction,
        dst: asyncio.StreamWriter,
        queue: asyncio.Queue[tuple[float, Rule, bytes]],
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, rule, data = await queue.get()
                if rule.action is Action.HOLD:
                    await self.proxy.released(direction)
                    if self.proxy.rules[direction].action is Action.DROP or self.cut:
                        self.proxy.counters.dropped[direction] += len(data)
                        self.lost_bytes = True
                        continue
                elif rule.action is Action.DELAY:
                    await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
                self.proxy.counters.delivered[direction] += len(data)
        except (ConnectionError, OSError):
            self.abort()

    def abort(self) -> None:
        _abort(self.client[1])
        _abort(self.node[1])
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for _, writer in (self.client, self.node):
            writer.close()


class Proxy:
    """Listens on a free loopback port and forwards to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int, name: str = "") -> None:
        self.target = (target_host, target_port)
        self.name = name or f"{target_host}:{target_port}"
        self.rules: dict[Direction, Rule] = dict.fromkeys(Direction, PASS)
        self.counters = Counters()
        self._open: dict[Direction, asyncio.Event] = {}
        self._pipes: set[_Pipe] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # one per accepted connection
        self._trigger: tuple[bytes, Rule, Direction | None] | None = None
        self.triggered = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Proxy:
        self._open = {d: asyncio.Event() for d in Direction}
        for event in self._open.values():
            event.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.abort()
        for event in self._open.values():
            event.set()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def released(self, direction: Direction) -> None:
        await self._open[direction].wait()

    def set(
        self, rule: Rule, direction: Direction | None = None, *, keep_cut: bool = False
    ) -> None:
        """``rule`` for one direction, or both when ``direction`` is None. ``keep_cut``: when
        no direction drops any more, connections that lost bytes stay cut instead of reset."""
        for d in [direction] if direction else list(Direction):
            self.rules[d] = rule
            if rule.action is Action.HOLD:
                self._open[d].clear()
            else:
                self._open[d].set()
        if rule.action is Action.RESET:
            self.reset()
        elif all(r.action is not Action.DROP for r in self.rules.values()):
            for pipe in list(self._pipes):
                if pipe.lost_bytes and keep_cut:
                    pipe.cut = True
                elif pipe.lost_bytes and not pipe.cut:
                    self._reset_pipe(pipe)

    def on_request(self, prefix: str, rule: Rule, direction: Direction | None = None) -> None:
        """Once: when a request whose first line starts with ``prefix`` arrives, ``rule`` is
        set before that request goes on (so its answer, or the request itself, is caught
        exactly). ``triggered`` is set then."""
        self.triggered.clear()
        self._trigger = (prefix.encode("latin-1"), rule, direction)

    def _on_request(self, line: bytes) -> None:
        if self._trigger is not None and line.startswith(self._trigger[0]):
            _, rule, direction = self._trigger
            self._trigger = None
            self.set(rule, direction)
            self.triggered.set()

    def hold(self, direction: Direction | None = None) -> None:
        self.set(HOLD, direction)

    def drop(self, direction: Direction | None = None) -> None:
        self.set(DROP, direction)

    def delay(self, seconds: float, direction: Direction | None = None) -> None:
        self.set(Rule.delay(seconds), direction)

    def release(self, direction: Direction | None = None) -> None:
        """Back to pass: what was held is delivered, in order."""
        self.set(PASS, direction)

    def heal(self, *, keep_cut: bool = False) -> None:
        """Both directions pass; connections that lost bytes are reset or, with ``keep_cut``,
        stay cut (a request that vanished in a partition and is never retried)."""
        self.set(PASS, keep_cut=keep_cut)

    def reset(self) -> None:
        """Resets every open connection (the rules stay)."""
        for pipe in list(self._pipes):
            self._reset_pipe(pipe)

    def _reset_pipe(self, pipe: _Pipe) -> None:
        self.counters.resets += 1
        pipe.abort()
        self._pipes.discard(pipe)

    def open_connections(self) -> int:
        return len(self._pipes)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._forward(reader, writer)
        finally:
            self._handlers.discard(handler)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        if Action.RESET in (self.rules[Direction.UP].action, self.rules[Direction.DOWN].action):
            self.counters.resets += 1
            _abort(writer)
            return
        try:
            node = await asyncio.open_connection(*self.target)
        except OSError:
            self.counters.resets += 1
            _abort(writer)  # the node is down: the client sees a reset, as without a proxy
            return
        pipe = _Pipe(self, (reader, writer), node)
        self._pipes.add(pipe)
        try:
            await pipe.wait()
        finally:
            self._pipes.discard(pipe)


class ProxyMesh:
    """A proxy per (client, node) pair, made on demand: ``mesh["w", "n1"]`` is client ``w``'s
    way to node ``n1``; ``overrides("w")`` is the ``address_override`` for client ``w``."""

    def __init__(self, nodes: dict[str, str]) -> None:
        self.nodes = dict(nodes)  # node id -> "http://host:port"
        self.proxies: dict[tuple[str, str], Proxy] = {}

    async def for_client(self, client: str) -> dict[str, str]:
        """Starts client ``client``'s proxies (one per node); answers its address_override."""
        for node_id, url in self.nodes.items():
            if (client, node_id) not in self.proxies:
                host, port = url.removeprefix("http://").rsplit(":", 1)
                proxy = Proxy(host, int(port), f"{client}->{node_id}")
                self.proxies[client, node_id] = await proxy.start()
        return self.overrides(client)

    def overrides(self, client: str) -> dict[str, str]:
        return {node: p.url for (c, node), p in self.proxies.items() if c == client}

    def __getitem__(self, pair: tuple[str, str]) -> Proxy:
        return self.proxies[pair]

    def to_node(self, node_id: str) -> list[Proxy]:
        """Every client's proxy in front of ``node_id``."""
        return [p for (_, node), p in self.proxies.items() if node == node_id]

    def heal(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()

    async def close(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()
