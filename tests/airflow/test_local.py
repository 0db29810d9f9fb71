"""`make airflow` as a user runs it, against a node run as `make run` runs it (settings as
shipped, an admin token): the real scheduler, DAG processor, triggerer and API server on a free
port with a temporary AIRFLOW_HOME (the Makefile's variables, overridden through MAKEFLAGS as
on a command line). The Airflow block of docs/deploying.md (`make airflow-cli ARGS=...`:
unpause, trigger) runs as written; the runs of storage_node_compaction and
storage_node_retention must succeed against the node, their task logs must be readable
through the API as in the UI, only loopback may be listened on, and stopping make by its pid
must leave no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.airflow.test_runs import TOKEN, call, rolling_stream
from tests.harness.devcluster import Supervisor
from tests.harness.hostdisk import REPO
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess
from tests.harness.ports import free_port
from tools.airflow_local import descendants, process_table

READY_TIMEOUT_S = 240.0  # a loaded 2-core machine: the DB migration and four Airflow imports
RUNS_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0  # the launcher's grace (20 s) and its kill
CLI_TIMEOUT_S = 120.0
POLL_S = 1.0
DAGS = ("storage_node_compaction", "storage_node_retention")
FENCED_SH = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def readme_cli_block(section: str = "Airflow: the fleet's lifecycle") -> str:
    page = (REPO / "docs" / "deploying.md").read_text()
    text = page.split(f"## {section}\n")[1]
    blocks = [b for b in FENCED_SH.findall(text.split("\n## ")[0]) if "airflow-cli" in b]
    assert len(blocks) == 1, blocks
    return str(blocks[0])


def tree(root: int) -> set[tuple[int, str]]:
    """The processes below root, with their start times."""
    table = process_table()
    return {(pid, table[pid][1]) for pid in descendants(root, table)}


def listening(pids: set[int]) -> list[str]:
    """The TCP sockets these processes listen on, as "hex address:port" of /proc/net."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                found.append(fields[1])
    return found


def is_loopback(address: str) -> bool:
    host = address.split(":")[0]
    # 127.0.0.0/8 little-endian in tcp, ::1 and ::ffff:127.x.x.x in tcp6
    return host.endswith("7F") and (len(host) == 8 or host.startswith("0000000000000000FFFF"))


class LocalAirflow:
    """``make airflow`` on a free port and ``home``, working on the node at ``node_url`` or,
    as a user's ``AIRFLOW_CLUSTER=...``, on the running ``make cluster`` under ``cluster``."""

    def __init__(self, home: Path, node_url: str = "", cluster: Path | None = None) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home.parent / "make-airflow.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        nodes = f"AIRFLOW_CLUSTER={cluster}" if cluster else f"AIRFLOW_NODE_URL={node_url}"
        env.update(
            NODE_ADMIN_TOKEN=TOKEN,
            MAKEFLAGS=f"AIRFLOW_PORT={self.port} AIRFLOW_HOME_DIR={home} {nodes}",
        )
        env.pop("MAKELEVEL", None)  # under `make test`: this is a make of its own
        self.env = env
        self.seen: set[tuple[int, str]] = set()
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = ""

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # A session of its own, as a terminal gives it.
            self.proc = subprocess.Popen(
                ["make", "airflow"],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_for(lambda: "airflow-local | ready:" in self.log(), READY_TIMEOUT_S, "ready")
        password = json.loads(
            (self.home / "simple_auth_manager_passwords.json.generated").read_text()
        )["admin"]
        self.token = self.request(
            "POST", "/auth/token", {"username": "admin", "password": password}
        )["access_token"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run_docs_block(self, section: str = "Airflow: the fleet's lifecycle") -> None:
        """The section's `make airflow-cli` block of docs/deploying.md, as written."""
        cli = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", readme_cli_block(section)],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
        assert cli.returncode == 0, f"{cli.stdout[-4000:]}\n{cli.stderr[-4000:]}"

    def wait_for(self, done: Any, timeout: float, what: str) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.seen |= tree(self.proc.pid)
            assert self.proc.poll() is None, f"make airflow exited:\n{self.log()[-8000:]}"
            if done():
                return
            time.sleep(POLL_S)
        raise AssertionError(f"not {what} after {timeout:.0f} s:\n{self.log()[-8000:]}")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns")["dag_runs"])

    def stop(self) -> None:
        """SIGTERM to make's pid alone (Ctrl-C sends SIGINT to its whole process group, which
        reaches the launcher directly: the easier case)."""
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(STOP_TIMEOUT_S)

    def kill(self) -> None:
        """Whatever the test's outcome, nothing of this Airflow survives it."""
        if self.proc is not None:
            self.seen |= tree(self.proc.pid)
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid, _ in left(self.seen):
            with contextlib.suppress(ProcessLookupError):  # it ended since the table was read
                os.kill(pid, signal.SIGKILL)


def left(seen: set[tuple[int, str]]) -> set[tuple[int, str]]:
    table = process_table()
    return {(pid, started) for pid, started in seen if table.get(pid, (0, ""))[1] == started}


@pytest.fixture
def local_airflow(tmp_path: Path) -> Iterator[tuple[LocalAirflow, NodeProcess]]:
    node = NodeProcess(tmp_path / "data", {**DEFAULT_SETTINGS, "NODE_ADMIN_TOKEN": TOKEN})
    node.start()
    instance = LocalAirflow(tmp_path / "airflow-home", node.url)
    try:
        yield instance, node
    finally:
        instance.kill()


def test_make_airflow_runs_the_dags_against_the_node(
    local_airflow: tuple[LocalAirflow, NodeProcess],
) -> None:
    airflow, node = local_airflow
    ledgers = rolling_stream(node, 3, retentionTimeInMinutes=0)  # all out of retention
    gc_before = call(node, "GET", "/api/v1/bookie/gc_details")[0]
    airflow.start()

    # The DAG processor has parsed the DAGs, which start paused.
    def parsed() -> bool:
        dags = airflow.request("GET", "/api/v2/dags")["dags"]
        return all(d["is_paused"] for d in dags) and {d["dag_id"] for d in dags} >= set(DAGS)

    airflow.wait_for(parsed, READY_TIMEOUT_S, "parsed")
    airflow.run_docs_block()

    def manual_runs() -> dict[str, dict[str, Any]]:
        found = {}
        for dag_id in DAGS:
            for run in airflow.runs(dag_id):
                if run["run_type"] == "manual":
                    found[dag_id] = run
        return found

    def finished() -> bool:
        runs = manual_runs()
        return len(runs) == len(DAGS) and all(
            r["state"] in ("success", "failed") for r in runs.values()
        )

    airflow.wait_for(finished, RUNS_TIMEOUT_S, "finished")
    runs = manual_runs()
    assert {d: r["state"] for d, r in runs.items()} == dict.fromkeys(DAGS, "success"), (
        airflow.log()[-8000:]
    )

    # Against the node: retention deleted the stream's ledgers, GC ran.
    stream = call(node, "GET", "/api/v1/streams/orders")
    assert stream["entries"] == 0
    assert not set(ledgers) & {x["ledgerId"] for x in stream["ledgers"]}
    gc_after = call(node, "GET", "/api/v1/bookie/gc_details")[0]
    counters = ("majorCompactionCounter", "minorCompactionCounter")
    assert sum(gc_after[c] for c in counters) > sum(gc_before[c] for c in counters)

    # The task log, as the UI reads it: the node's answer is in it (the ledgers may have gone
    # in the run that unpausing started).
    run_id = urllib.parse.quote(runs["storage_node_retention"]["dag_run_id"], safe="")
    log = airflow.request(
        "GET",
        f"/api/v2/dags/storage_node_retention/dagRuns/{run_id}/taskInstances/run_retention"
        "/logs/1?map_index=0",
    )
    text = json.dumps(log["content"])
    assert f"node {node.url}: deleted " in text, text[-3000:]

    # Only loopback is listened on, by any of Airflow's processes.
    assert airflow.proc is not None
    pids = {pid for pid, _ in tree(airflow.proc.pid)}
    addresses = listening(pids)
    assert addresses and all(is_loopback(a) for a in addresses), addresses

    started = time.monotonic()
    airflow.stop()
    assert "airflow-local | stopped" in airflow.log(), airflow.log()[-4000:]
    assert not left(airflow.seen), (left(airflow.seen), time.monotonic() - started)


AUTORECOVERY = "storage_node_autorecovery"


def test_make_airflow_works_on_a_running_make_cluster(tmp_path: Path) -> None:
    """The docs' block of "Airflow and make cluster" as written: the autorecovery DAG
    unpaused and triggered with a --conf through make airflow-cli; the run succeeds against
    the cluster's nodes and store, and carries the conf as JSON."""
    cluster = Supervisor(tmp_path / "cluster", nodes=2)
    airflow = LocalAirflow(tmp_path / "airflow-home", cluster=cluster.root)
    try:
        airflow.start()
        assert f"working on the make cluster under {cluster.root}: nodes " in airflow.log()
        assert cluster.state["metadataUrl"] in airflow.log(), airflow.log()[-4000:]

        def parsed() -> bool:
            dags = airflow.request("GET", "/api/v2/dags")["dags"]
            return AUTORECOVERY in {d["dag_id"] for d in dags}

        airflow.wait_for(parsed, READY_TIMEOUT_S, "parsed")
        airflow.run_docs_block("Airflow and `make cluster`")

        def manual() -> dict[str, Any] | None:
            runs = [r for r in airflow.runs(AUTORECOVERY) if r["run_type"] == "manual"]
            return runs[0] if runs else None

        airflow.wait_for(
            lambda: (manual() or {}).get("state") in ("success", "failed"),
            RUNS_TIMEOUT_S,
            "finished",
        )
        run = manual()
        assert run is not None and run["state"] == "success", airflow.log()[-8000:]
        assert run["conf"] == {"lost_node_recovery_delay_s": 0}, run
    finally:
        airflow.kill()
        assert cluster.interrupt() == 0
