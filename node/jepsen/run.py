"""``python -m node bench jepsen --runs N --seed S``: N seeded fault runs against one local
cluster (etcd and five nodes), each a random workload and a random nemesis, then recovery of
every ledger and the checker. Prints one line per run and a summary (runs, clean runs, runs
with violations, operations with an unknown outcome, the seeds of failing runs); exit 1 when a
run broke a rule or could not be checked.

A run with seed S: 1-2 writer processes (E/Qw/Qa drawn per writer), each behind its own
proxies, add at random while readers (workload.Reader, in this process) read their ledgers
without recovery; meanwhile 1-2 faults hit within ``--seconds``, each healed after a random
while. Then everything is healed, the writers close their ledgers (or leave them open, as a
crash would), a fresh client recovers every ledger, the readers read each once more (whole,
now that it is closed) and stop, and fresh readers check the ledgers against the history,
reads included. Its histories
stay under ``<dir>/seed-S/`` when it failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from node.client import Client, ClientError
from node.jepsen.checker import Verdict, check_cluster
from node.jepsen.history import History, load_async, merge
from node.jepsen.nemesis import Nemesis
from node.jepsen.proxy import ProxyMesh
from node.jepsen.workload import ChildWriter, Reader, WriterConfig, recover
from node.localcluster import LocalCluster

NODES = 5  # enough for E=4 with a spare, so a failed node can always be replaced
SHAPES = [(3, 3, 2), (3, 2, 2), (4, 3, 2), (3, 3, 3), (4, 2, 1)]  # (E, Qw, Qa) drawn per writer
MAX_WRITERS = 2
READER_TASKS = 2  # readers of a run, each on every writer's ledger
MAX_FAULTS = 2
FAULT_HOLD_MIN_S = 0.3  # a fault lasts at least ...
FAULT_HOLD_MAX_S = 1.5  # ... and at most, before it is healed
CLOSE_SHARE = 0.5  # share of live writers that close their ledger (the rest leave it open)
WRITER_GRACE_S = 60.0  # past --seconds, for a writer's in-flight adds to end (timeouts included)
RECOVERY_ATTEMPTS = 3  # a recovery that fails right after healing is tried again ...
RECOVERY_RETRY_S = 2.0  # ... after this pause
# The checker's counts of reads the summary adds up (checker.py): read operations, those
# that got all they asked, the entries they returned, and what replicas served past an end.
READ_COUNTS = ("reads", "reads_ok", "read_entries", "leftovers", "probe_errors")
ERROR_LINE_CHARS = 200  # of a run's error on its line (verdict.json keeps it whole)


@dataclass
class RunResult:
    seed: int
    faults: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # of the faults
    verdict: Verdict | None = None
    error: str = ""
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.error and self.verdict is not None and self.verdict.ok

    def line(self) -> str:
        faults = ", ".join(self.faults) or "no fault"
        if self.error:
            outcome = f"ERROR {self.error.splitlines()[0][:ERROR_LINE_CHARS]}"
        else:
            assert self.verdict is not None
            counts = " ".join(f"{k}={v}" for k, v in sorted(self.verdict.counts.items()))
            outcome = f"{counts} " + (
                "clean" if self.verdict.ok else f"VIOLATIONS: {self.verdict.violations}"
            )
        return f"seed {self.seed} ({self.seconds:.1f}s) [{faults}]: {outcome}"


async def _recover_all(metadata_url: str, ledgers: list[int], history: History) -> None:
    async with Client(metadata_url) as client:
        for lid in ledgers:
            for attempt in range(1, RECOVERY_ATTEMPTS + 1):
                try:
                    await recover(client, history, lid)
                    break
                except ClientError:
                    if attempt == RECOVERY_ATTEMPTS:
                        raise
                    await asyncio.sleep(RECOVERY_RETRY_S)


async def one_run(cluster: LocalCluster, seed: int, seconds: float, work: Path) -> RunResult:
    rng = random.Random(seed)
    result = RunResult(seed)
    started = time.monotonic()
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    mesh = ProxyMesh({n: cluster.url(n) for n in cluster.node_ids})
    writers: list[ChildWriter] = []
    stop_reading = asyncio.Event()
    reading: list[asyncio.Task[None]] = []
    try:
        for i in range(rng.randint(1, MAX_WRITERS)):
            process = f"w{i}"
            e, wq, aq = rng.choice(SHAPES)
            config = WriterConfig(
                metadata_url=cluster.metadata_url,
                process=process,
                history=str(work / f"{process}.jsonl"),
                seed=rng.randrange(1 << 32),
                ensemble=e,
                write_quorum=wq,
                ack_quorum=aq,
                address_override=await mesh.for_client(process),
            )
            writers.append(ChildWriter(config, work / f"{process}.log"))
        for writer in writers:
            await writer.start()
        ledgers = sorted(w.ledger_id for w in writers)
        readers = [History(f"rd{i}") for i in range(READER_TASKS)]
        reading = [
            asyncio.create_task(_read(cluster.metadata_url, h, seed, ledgers, stop_reading))
            for h in readers
        ]
        recoverer = History("r")
        nemesis = Nemesis(cluster, mesh, writers, rng, recoverer)
        for writer in writers:  # writing until the last fault may have hit
            writer.send(f"random {seconds + FAULT_HOLD_MAX_S}")
        for _ in range(rng.randint(1, MAX_FAULTS)):
            await asyncio.sleep(rng.uniform(0, seconds / MAX_FAULTS))
            fault = nemesis.random_fault()
            result.faults.append(fault.name)
            result.kinds.append(fault.kind)
            await fault.apply()
            await asyncio.sleep(rng.uniform(FAULT_HOLD_MIN_S, FAULT_HOLD_MAX_S))
            await fault.heal()
        await nemesis.heal_all()
        for writer in writers:
            await _finish(writer, rng)
        try:
            await _recover_all(cluster.metadata_url, ledgers, recoverer)
        finally:
            await asyncio.to_thread(recoverer.dump, work / "r.jsonl")
            stop_reading.set()
            await asyncio.gather(*reading)
            for h in readers:
                await asyncio.to_thread(h.dump, work / f"{h.process}.jsonl")
        ops = merge(
            await load_async(work / f"{w.config.process}.jsonl" for w in writers),
            recoverer.ops,
            *(h.ops for h in readers),
        )
        result.verdict = await check_cluster(ops, cluster.metadata_url)
    except (ClientError, RuntimeError, TimeoutError, OSError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        stop_reading.set()
        await asyncio.gather(*reading, return_exceptions=True)
        for writer in writers:
            await writer.kill()
        await mesh.close()
        result.seconds = time.monotonic() - started
    return result


async def _read(
    metadata_url: str, history: History, seed: int, ledgers: list[int], stop: asyncio.Event
) -> None:
    # Seeded apart from the run's RNG: a seed draws the same writers and faults as before.
    rng = random.Random(f"{seed}-{history.process}")
    async with Client(metadata_url, rng=random.Random(rng.random())) as client:
        await Reader(client, history, rng, ledgers).run(stop)


async def _healed(cluster: LocalCluster, root: Path, generation: int) -> LocalCluster:
    """``cluster`` with every process up (after a run that ended in an error, a fault may be
    left in place), or a new cluster when it cannot be healed."""
    try:
        await Nemesis(cluster, ProxyMesh({}), [], random.Random()).heal_all()
        return cluster
    except (RuntimeError, OSError) as error:
        print(f"  the cluster could not be healed ({error}); starting a new one", flush=True)
    await asyncio.to_thread(cluster.close)
    return await asyncio.to_thread(LocalCluster, root / f"cluster{generation}", NODES)


async def _finish(writer: ChildWriter, rng: random.Random) -> None:
    """Waits for the writer's workload; then it closes its ledger or leaves it open."""
    if writer.proc is None or writer.proc.returncode is not None:
        return
    try:
        await asyncio.wait_for(writer.answer(), WRITER_GRACE_S)
        if rng.random() < CLOSE_SHARE:
            await asyncio.wait_for(writer.command("close"), WRITER_GRACE_S)
        await asyncio.wait_for(writer.finish(), WRITER_GRACE_S)
    except RuntimeError:
        if writer.proc.returncode is None:
            raise  # it answered nonsense; a killed writer ends its answers, which is fine


async def run_all(runs: int, seed: int, seconds: float, root: Path) -> list[RunResult]:
    results: list[RunResult] = []
    cluster = await asyncio.to_thread(LocalCluster, root / "cluster0", NODES)
    try:
        for i in range(runs):
            work = root / f"seed-{seed + i}"
            result = await one_run(cluster, seed + i, seconds, work)
            results.append(result)
            print(f"run {i + 1}/{runs} {result.line()}", flush=True)
            if result.error:
                cluster = await _healed(cluster, root, i + 1)
            if result.clean:
                await asyncio.to_thread(shutil.rmtree, work, True)
            else:
                await asyncio.to_thread(_write_verdict, work, result)
    finally:
        await asyncio.to_thread(cluster.close)
    return results


def _write_verdict(work: Path, result: RunResult) -> None:
    verdict = result.verdict.to_dict() if result.verdict else None
    body = {"seed": result.seed, "faults": result.faults, "error": result.error}
    (work / "verdict.json").write_text(json.dumps({**body, "verdict": verdict}, indent=1))


def summarize(results: list[RunResult]) -> tuple[str, bool]:
    """The summary's text, and whether every run was clean."""
    unknown = sum(
        r.verdict.counts.get("info", 0) + r.verdict.counts.get("unfinished", 0)
        for r in results
        if r.verdict
    )
    acked = sum(r.verdict.counts.get("ok", 0) for r in results if r.verdict)
    reads = Counter[str]()
    for r in results:
        if r.verdict:
            reads.update({k: r.verdict.counts.get(k, 0) for k in READ_COUNTS})
    violating = [r for r in results if r.verdict and not r.verdict.ok]
    errored = [r for r in results if r.error]
    kinds: Counter[str] = Counter(v.kind for r in violating for v in r.verdict.violations)  # type: ignore[union-attr]
    lines = [
        f"runs: {len(results)}",
        f"clean: {sum(r.clean for r in results)}",
        f"with violations: {len(violating)} {dict(kinds) if kinds else ''}".rstrip(),
        f"could not be checked (errors): {len(errored)}",
        f"operations ok: {acked}, unknown outcome (info or unfinished): {unknown}",
        "reads: " + ", ".join(f"{k} {reads[k]}" for k in READ_COUNTS),
        f"faults: {dict(Counter(kind for r in results for kind in r.kinds))}",
    ]
    failing = [r.seed for r in violating + errored]
    if failing:
        lines.append(f"failing seeds: {sorted(failing)}")
    return "\n".join(lines), not failing


def main(args: argparse.Namespace) -> int:
    root = args.dir or Path(tempfile.mkdtemp(prefix="jepsen-"))
    print(f"jepsen: {args.runs} runs from seed {args.seed}, {args.seconds}s each, in {root}")
    results = asyncio.run(run_all(args.runs, args.seed, args.seconds, root))
    text, clean = summarize(results)
    print(text)
    if clean and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if clean else 1
