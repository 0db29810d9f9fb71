"""Writers whose every operation goes into a history, in this process or as a child process
that a test or the nemesis may SIGKILL.

``Writer`` wraps a client's ledger handle: ``add``, ``add_batch`` and ``close`` log ``invoke``
then ``ok``, ``fail`` (NOTHING_SENT: the client sent nothing) or ``info`` (every other error:
the outcome is unknown). Payloads are unique in a run (process, ledger, counter), so a
digest names its add.

As a child process (``python -m node.jepsen.workload CONFIG_JSON``) the writer appends its
history to a file line by line and answers commands on stdin, one per line, each answered on
stdout (``ledger <id>`` first, once the ledger exists):

==============  ===========================================================================
add N           N adds one after the other                          -> ``done <last ok id>``
batch N         one add_batch of N entries                          -> ``done <last ok id>``
spawn N         N adds started together, not awaited                -> ``sent``
close           close the ledger                                    -> ``closed <lastEntryId>``
random S        S seconds of random adds and batches, ``concurrency`` at a time
                                                                    -> ``done <last ok id>``
==============  ===========================================================================

An answer of ``-2`` means the operation ended without an ok. End of stdin ends the process
(without closing the ledger: a crashed writer's state).

``Reader`` reads the ledgers while they are written (in the process that runs the faults):
each round opens one without recovery (nothing fenced), logs the LAC it was told (or the end
of a closed ledger) and reads entries up to it, every read an operation of the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.client import (
    AddFailed,
    Client,
    ClientError,
    LedgerClosedError,
    LedgerFencedError,
    LedgerHandle,
    ReadHandle,
    ReplicaError,
)
from node.client.bookies import within
from node.client.recovery import PhaseHook
from node.jepsen.history import ABSENT, History, Op, OpFunction, digest

# The errors of an add that sent nothing (a handle already unusable): "fail", the add's bytes
# must be nowhere. Every other error leaves the outcome unknown ("info").
NOTHING_SENT = (AddFailed, LedgerClosedError, LedgerFencedError)
NO_OK = -2  # answer of a command none of whose operations ended ok
PAYLOAD_PAD = 64  # random bytes after a payload's unique name: not all payloads the same size
READ_CHUNK = 16  # entries of one read operation at most
READ_PAUSE_S = 0.02  # between two rounds of a reader: readers share the CPU with the writers
RANDOM_READ_SHARE = 0.5  # of an open ledger's rounds that also read a range below the LAC
ERROR_CHARS = 200  # of a read's error in the history


@dataclass
class WriterConfig:
    metadata_url: str
    process: str = "w0"
    history: str = ""  # file to append the history to ("": in memory only)
    seed: int = 0
    ensemble: int = 3
    write_quorum: int = 3
    ack_quorum: int = 2
    address_override: dict[str, str] = field(default_factory=dict)
    concurrency: int = 4  # adds in flight in ``random``
    batch_max: int = 8  # entries of a random batch at most
    client: dict[str, Any] = field(default_factory=dict)  # more Client(...) keyword arguments

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


class Writer:
    """One ledger's writer: its operations into ``history``."""

    def __init__(self, ledger: LedgerHandle, history: History, rng: random.Random) -> None:
        self.ledger = ledger
        self.history = history
        self.rng = rng
        self.count = 0
        self.last_ok = -1
        self.pending: set[asyncio.Task[int]] = set()
        self.unusable = False  # an add was refused at once: the handle is fenced or closed

    @staticmethod
    async def create(
        client: Client, history: History, rng: random.Random, ensemble: int, wq: int, aq: int
    ) -> Writer:
        return Writer(await client.create_ledger(ensemble, wq, aq), history, rng)

    def payload(self) -> bytes:
        self.count += 1
        name = f"{self.history.process}-{self.ledger.id}-{self.count}-".encode()
        return name + self.rng.randbytes(self.rng.randrange(PAYLOAD_PAD))

    def _outcome(self, f: OpFunction, error: BaseException, digests: str | list[str]) -> None:
        if isinstance(error, NOTHING_SENT):
            self.unusable = True
            self.history.log("fail", f, self.ledger.id, None, digests)
        else:
            self.history.log("info", f, self.ledger.id, None, digests)

    async def add(self) -> int:
        """The id of an ok add, NO_OK otherwise (logged either way)."""
        data = self.payload()
        d = digest(data)
        self.history.log("invoke", "add", self.ledger.id, None, d)
        try:
            entry = await self.ledger.add(data)
        except Exception as error:
            self._outcome("add", error, d)
            return NO_OK
        self.history.log("ok", "add", self.ledger.id, entry, d)
        self.last_ok = max(self.last_ok, entry)
        return entry

    async def add_batch(self, n: int) -> int:
        """The last id of an ok batch, NO_OK otherwise."""
        payloads = [self.payload() for _ in range(n)]
        digests = [digest(p) for p in payloads]
        self.history.log("invoke", "add_batch", self.ledger.id, None, digests)
        try:
            first, last = await self.ledger.add_batch(payloads)
        except Exception as error:
            self._outcome("add_batch", error, digests)
            return NO_OK
        self.history.log("ok", "add_batch", self.ledger.id, first, digests)
        self.last_ok = max(self.last_ok, last)
        return last

    def spawn(self, n: int) -> None:
        for _ in range(n):
            task = asyncio.get_running_loop().create_task(self.add())
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def close(self) -> int:
        """lastEntryId of an ok close, NO_OK otherwise."""
        self.history.log("invoke", "close", self.ledger.id)
        try:
            meta = await self.ledger.close()
        except Exception:
            self.history.log("info", "close", self.ledger.id)
            return NO_OK
        self.history.log("ok", "close", self.ledger.id, meta.last_entry_id)
        return meta.last_entry_id

    async def random(self, seconds: float, concurrency: int, batch_max: int) -> int:
        """Random adds and batches, ``concurrency`` at a time, for ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds

        async def one_writer() -> None:
            while loop.time() < deadline and not self.unusable:
                if self.rng.random() < 0.3:
                    await self.add_batch(self.rng.randint(1, batch_max))
                else:
                    await self.add()

        await asyncio.gather(*(one_writer() for _ in range(concurrency)))
        return self.last_ok

    async def wait_pending(self) -> None:
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


async def recover(
    client: Client, history: History, ledger_id: int, on_phase: PhaseHook | None = None
) -> dict[str, Any]:
    """``client.recover_ledger`` logged: ok with the lastEntryId it closed at, info on error."""
    history.log("invoke", "recover", ledger_id)
    try:
        meta = await client.recover_ledger(ledger_id, on_phase=on_phase)
    except Exception:
        history.log("info", "recover", ledger_id)
        raise
    history.log("ok", "recover", ledger_id, meta["lastEntryId"])
    return meta


async def ask_replicas(
    client: Client, ledger_id: int, entry_id: int, nodes: list[str]
) -> dict[str, bytes | ReplicaError]:
    """``entry_id`` read from each of ``nodes`` itself, unfenced, past any range check of the
    client: each one's payload or its error."""

    async def one(node: str) -> bytes | ReplicaError:
        call = client.transport.read_entry(node, ledger_id, entry_id, fence=False)
        try:
            return await within(node, call, client.read_timeout_s)
        except ReplicaError as error:
            return error

    answers = await asyncio.gather(*(one(node) for node in nodes))
    return dict(zip(nodes, answers, strict=True))


class Reader:
    """Reads ``ledgers`` while they are written: each round opens one without recovery and
    logs the LAC (``read_lac``; a closed ledger's ``last`` is its lastEntryId), then reads on
    from where it stopped up to that LAC and, now and then, a random range below it; a closed
    ledger is read whole, once. Every read is logged (history.py: what came back, and for a
    read that ended early whether the next id was absent from its whole write set)."""

    def __init__(
        self, client: Client, history: History, rng: random.Random, ledgers: list[int]
    ) -> None:
        self.client = client
        self.history = history
        self.rng = rng
        self.ledgers = ledgers
        self.next: dict[int, int] = {}  # ledger -> the first id not read yet
        self.whole: set[int] = set()  # closed ledgers read whole

    async def open(self, ledger_id: int) -> ReadHandle | None:
        self.history.log("invoke", "read_lac", ledger_id)
        try:
            handle = await self.client.open_ledger(ledger_id)
        except (ClientError, OSError, TimeoutError) as error:
            self.history.log("info", "read_lac", ledger_id, error=_why(error))
            return None
        end = handle.last_entry_id if handle.closed else None
        self.history.log("ok", "read_lac", ledger_id, handle.last_entry_id, last=end)
        return handle

    async def read(self, handle: ReadHandle, first: int, last: int) -> Op:
        """One read operation of ``first``..``last`` (at most the handle's last entry id)."""
        self.history.log("invoke", "read", handle.id, first, last=last)
        got: list[str] = []
        try:
            async for _, payload in handle.read(first, last):
                got.append(digest(payload))
        except (ClientError, OSError, TimeoutError) as error:
            failed = first + len(got)
            if await self._absent(handle, failed):
                return self.history.log(
                    "fail", "read", handle.id, first, got, last=last, error=ABSENT
                )
            return self.history.log(
                "info", "read", handle.id, first, got, last=last, error=_why(error)
            )
        return self.history.log("ok", "read", handle.id, first, got, last=last)

    async def _absent(self, handle: ReadHandle, entry_id: int) -> bool:
        """Every replica of the entry's write set says it holds no such entry (asked again
        one by one: the read's own error does not say why each replica failed)."""
        nodes = handle.metadata.write_set(entry_id)
        answers = await ask_replicas(self.client, handle.id, entry_id, nodes)
        return all(isinstance(a, ReplicaError) and a.absent for a in answers.values())

    async def round(self, ledger_id: int) -> None:
        handle = await self.open(ledger_id)
        if handle is None:
            return
        end = handle.last_entry_id
        if handle.closed:
            if ledger_id not in self.whole:
                self.whole.add(ledger_id)
                for first in range(0, end + 1, READ_CHUNK):
                    await self.read(handle, first, min(end, first + READ_CHUNK - 1))
            return
        start = self.next.get(ledger_id, 0)
        if start <= end:
            last = min(end, start + READ_CHUNK - 1)
            if (await self.read(handle, start, last)).type == "ok":
                self.next[ledger_id] = last + 1
        if end >= 0 and self.rng.random() < RANDOM_READ_SHARE:
            first = self.rng.randint(0, end)
            await self.read(handle, first, min(end, first + self.rng.randrange(READ_CHUNK)))

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds on ledgers drawn at random until ``stop``; then one round of each."""
        while not stop.is_set():
            await self.round(self.rng.choice(self.ledgers))
            await asyncio.sleep(READ_PAUSE_S)
        for ledger_id in self.ledgers:
            await self.round(ledger_id)


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


def make_client(config: WriterConfig, overrides: Mapping[str, str] | None = None) -> Client:
    return Client(
        config.metadata_url,
        address_override=dict(overrides or config.address_override),
        rng=random.Random(config.seed),
        **config.client,
    )


async def _serve_commands(config: WriterConfig) -> None:
    """The child process: commands from stdin, answers on stdout (the module's docstring)."""
    rng = random.Random(config.seed)
    history = History(config.process, Path(config.history) if config.history else None)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def answer(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async with make_client(config) as client:
        writer = await Writer.create(
            client, history, rng, config.ensemble, config.write_quorum, config.ack_quorum
        )
        answer(f"ledger {writer.ledger.id}")
        while line := (await reader.readline()).decode().strip():
            command, _, arg = line.partition(" ")
            n = int(arg) if arg.isdigit() else 1
            if command == "add":
                last = NO_OK
                for _ in range(n):
                    last = max(last, await writer.add())
                answer(f"done {last}")
            elif command == "batch":
                answer(f"done {await writer.add_batch(n)}")
            elif command == "spawn":
                writer.spawn(n)
                answer("sent")
            elif command == "close":
                await writer.wait_pending()
                answer(f"closed {await writer.close()}")
            elif command == "random":
                answer(
                    f"done {await writer.random(float(arg), config.concurrency, config.batch_max)}"
                )
            else:
                answer(f"error unknown command {command!r}")
        for task in writer.pending:
            task.cancel()
        with contextlib.suppress(Exception):
            await writer.wait_pending()
    history.close()


def main(argv: list[str]) -> int:
    config = WriterConfig(**json.loads(argv[0]))
    asyncio.run(_serve_commands(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


class ChildWriter:
    """A writer in a child process (the module's docstring), driven line by line; its history
    file survives a SIGKILL. ``log``: where its stderr goes."""

    def __init__(self, config: WriterConfig, log: Path) -> None:
        self.config = config
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.ledger_id = -1

    async def start(self) -> int:
        """Starts it; the id of the ledger it created."""
        err = await asyncio.to_thread(self.log.open, "ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "node.jepsen.workload",
                self.config.to_json(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        finally:
            await asyncio.to_thread(err.close)
        kind, _, value = (await self._line()).partition(" ")
        if kind != "ledger":
            raise RuntimeError(f"writer {self.config.process}: {kind} {value}")
        self.ledger_id = int(value)
        return self.ledger_id

    async def _line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = (await self.proc.stdout.readline()).decode().strip()
        if not line:
            code = await self.proc.wait()
            tail = (await asyncio.to_thread(self.log.read_text))[-3000:]
            raise RuntimeError(f"writer {self.config.process} exited with {code}:\n{tail}")
        return line

    def send(self, command: str) -> None:
        """Sends a command without waiting for its answer (``answer`` reads it)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")

    async def answer(self) -> int:
        """The number in the next answer (``done N``, ``closed N``; ``sent``: 0)."""
        kind, _, value = (await self._line()).partition(" ")
        if kind == "error":
            raise RuntimeError(f"writer {self.config.process}: {value}")
        return int(value) if value else 0

    async def command(self, command: str) -> int:
        self.send(command)
        return await self.answer()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signum)

    async def kill(self) -> None:
        """SIGKILL (a crashed writer: its ledger stays OPEN)."""
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()

    async def finish(self) -> int:
        """Ends stdin and waits for the exit (the ledger is left as it is)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.close()
        return await self.proc.wait()
