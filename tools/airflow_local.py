"""Airflow for a try-out on one machine (`make airflow`): the metadata DB migrated, then the
scheduler, the DAG processor, the triggerer and the API server, until Ctrl-C or SIGTERM.

Run by .venv-airflow's Python with the environment the Makefile sets (AIRFLOW_HOME, the DAGs
folder, the API's address and the execution API's URL). The nodes it works on: a running
`make cluster`'s (AIRFLOW_CLUSTER=DIR, or ./cluster when one runs there and no node URL was
given), whose nodes become the static discovery and whose metadata store the Variable
storage_node_metadata (the autorecovery DAG's); else the node of `make run`.
`airflow_local.py cli ARGS` runs the Airflow CLI with the same Variables (`make airflow-cli`).

Not `airflow standalone`, for two reasons: its scheduler and triggerer serve their logs on
every interface (ports 8793 and 8794; no option reaches them through standalone, while the API
server reads the log files itself on one machine), and a SIGTERM to it leaves its components
and their task workers running. Here each component runs in its own session (Ctrl-C reaches
this process only, which stops them in order); this process is their child subreaper, so a task
process orphaned on the way is still its descendant, and whatever is left after the grace
period is killed."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

COMPONENTS = {
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
    "api-server": ["api-server"],
}
STOP_GRACE_S = 20.0  # for the components to finish their shutdown before the kill
READY_TIMEOUT_S = 300.0  # first start: the DB migration and the API server's imports
POLL_S = 0.5
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
# node/devcluster.py's STATE_FILE, in a running `make cluster`'s directory: its pid, its
# metadata store's URL and its nodes' (read here without the node package: this venv lacks it).
CLUSTER_STATE = "devcluster.json"
DISCOVERY_ENV = "AIRFLOW_VAR_STORAGE_NODE_DISCOVERY"
METADATA_ENV = "AIRFLOW_VAR_STORAGE_NODE_METADATA"


class Stop(Exception):
    """Ctrl-C, SIGTERM or SIGHUP: stop every component."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time in clock ticks: tells a reused pid apart), from /proc (no
    psutil in the node's venv, which lints this and whose tests use it); zombies left out."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def descendants(pid: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """Every live process below pid."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in (table or process_table()).items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running_cluster(root: Path) -> dict[str, Any] | None:
    """The state of the `make cluster` running under root, or None (no file, or the process
    that wrote it is gone: a cluster killed with SIGKILL leaves it behind)."""
    try:
        state: dict[str, Any] = json.loads((root / CLUSTER_STATE).read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return state


def storage_variables(environ: dict[str, str]) -> tuple[dict[str, str], str]:
    """The Variables' environment for the nodes to work on, and a line saying which they are.
    AIRFLOW_CLUSTER (a directory: its cluster must run) wins over AIRFLOW_CLUSTER_PROBE (the
    Makefile's ./cluster, when no node URL was given: used if a cluster runs there); else
    the discovery the Makefile set is kept."""
    explicit = environ.get("AIRFLOW_CLUSTER", "")
    root = explicit or environ.get("AIRFLOW_CLUSTER_PROBE", "")
    state = running_cluster(Path(root)) if root else None
    if state is None and explicit:
        raise SystemExit(
            f"airflow-local | AIRFLOW_CLUSTER={explicit}: no `make cluster` runs there (no "
            f"{Path(explicit) / CLUSTER_STATE} of a live process): start it first"
        )
    if state is None:
        discovery = environ.get(DISCOVERY_ENV, "")
        return {}, (
            f"working on the nodes of {discovery}; no `make cluster` running"
            f"{f' under {root}' if root else ''}, so storage_node_metadata (the autorecovery "
            "DAG's) is not set: start `make cluster` first, or pass AIRFLOW_CLUSTER=DIR"
        )
    urls = sorted(state["nodes"].values())
    variables = {
        DISCOVERY_ENV: json.dumps({"kind": "static", "urls": urls}),
        METADATA_ENV: str(state["metadataUrl"]),
    }
    return variables, (
        f"working on the make cluster under {root}: nodes {', '.join(urls)}; "
        f"storage_node_metadata {state['metadataUrl']}"
    )


def api_url() -> str:
    return f"http://{os.environ['AIRFLOW__API__HOST']}:{os.environ['AIRFLOW__API__PORT']}"


def wait_ready(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        check_running(procs)
        try:
            with urllib.request.urlopen(f"{api_url()}/api/v2/monitor/health", timeout=2):
                pass
        except (OSError, urllib.error.URLError):
            time.sleep(POLL_S)
            continue
        home = os.environ["AIRFLOW_HOME"]
        print(
            f"airflow-local | ready: {api_url()} (user admin, password in "
            f"{home}/simple_auth_manager_passwords.json.generated); Ctrl-C stops Airflow",
            flush=True,
        )
        return
    raise SystemExit(f"airflow-local | the API server did not answer in {READY_TIMEOUT_S:.0f} s")


def check_running(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise SystemExit(f"airflow-local | {name} exited with {proc.returncode}")


def stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    while any(proc.poll() is None for proc in procs.values()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    # LocalExecutor workers and task processes that outlived their component: orphans
    # re-parented to this subreaper, or still below a component that ignored the SIGTERM.
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break


def cli(args: list[str]) -> None:
    """The Airflow CLI with the Variables of the nodes `make airflow` works on."""
    variables, _ = storage_variables(dict(os.environ))
    os.execve(AIRFLOW, [AIRFLOW, *args], {**os.environ, **variables})


def main() -> None:
    if sys.argv[1:2] == ["cli"]:
        cli(sys.argv[2:])
    variables, working_on = storage_variables(dict(os.environ))
    os.environ.update(variables)  # the components' environment, and their tasks'
    print(f"airflow-local | {working_on}", flush=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        subprocess.run([AIRFLOW, "db", "migrate"], check=True, stdout=subprocess.DEVNULL)
        for name, args in COMPONENTS.items():
            procs[name] = subprocess.Popen([AIRFLOW, *args], start_new_session=True)
        wait_ready(procs)
        while True:
            check_running(procs)
            time.sleep(POLL_S)
    except Stop as why:
        print(f"airflow-local | {why}: stopping Airflow", flush=True)
    finally:
        stop(procs)
    print("airflow-local | stopped", flush=True)


if __name__ == "__main__":
    main()
