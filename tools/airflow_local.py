"""Airflow for a try-out on one machine (`make airflow`): the metadata DB migrated, then the
scheduler, the DAG processor, the triggerer and the API server, until Ctrl-C or SIGTERM.

Run by .venv-airflow's Python with the environment the Makefile sets (AIRFLOW_HOME, the DAGs
folder, the API's address and the execution API's URL). Not `airflow standalone`, for two
reasons: its scheduler and triggerer serve their logs on every interface (ports 8793 and 8794;
no option reaches them through standalone, while the API server reads the log files itself on
one machine), and a SIGTERM to it leaves its components and their task workers running. Here
each component runs in its own session (Ctrl-C reaches this process only, which stops them in
order); this process is their child subreaper, so a task process orphaned on the way is still
its descendant, and whatever is left after the grace period is killed."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

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


def main() -> None:
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
