"""etcd and N nodes on loopback as real processes: the replicated tests, ``make cluster`` and
the benches that need more than one node start them through ``LocalCluster``.

Everything lives under one root directory: ``etcd/`` (etcd's data and log), ``n<i>/`` (node
``n<i>``'s data directory) and ``n<i>.log``. Ports are free loopback ports chosen once, so a
restarted process comes back at the same address (what the registration and the proxies in
front of it name). The calls block (subprocesses, polling): asynchronous code runs them in a
thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from node.client.model import node_key

ETCD_BINARY = "/usr/bin/etcd"  # Debian's etcd-server, installed by `make tools`
READY_TIMEOUT_S = 30.0  # a node or etcd that has not answered by then failed to start
READY_POLL_S = 0.05  # between two readiness probes
PROBE_TIMEOUT_S = 1.0  # one readiness probe
STOP_TIMEOUT_S = 10.0  # SIGTERM's grace before SIGKILL
LOG_TAIL_CHARS = 3000  # of a log quoted in an error
METADATA_PREFIX = "storage"  # the cluster's key prefix in etcd (NODE_METADATA_URL's path)


# Ports of processes that are killed and restarted on the same port: below the kernel's
# ephemeral range (32768-60999 by default), where a kernel-chosen port (bind to 0) and the
# local end of any outgoing connection live. A port from there can be taken by a connection
# while its process is down, and the restart then fails with "address already in use".
# Under pytest-xdist each worker takes a share and never hands a port out twice: a share must
# outlast a worker's whole run (with three workers, a share of 333 ran out).
PORTS = range(20000, 32000)
STOPPED_TIMEOUT_S = 5.0  # for a SIGSTOPped process to be stopped (the signal is asynchronous)
_handed_out: set[int] = set()  # chosen in this process, perhaps not listened on yet


def _ports() -> range:
    """PORTS, or under pytest-xdist this worker's share of it: a node killed in one worker's
    test leaves its port free until its restart, and another worker's next cluster must not
    take it meanwhile."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return PORTS
    share = len(PORTS) // count
    start = PORTS.start + int(worker.removeprefix("gw")) % count * share
    return range(start, start + share)


def free_port() -> int:
    """A loopback port of PORTS that nobody listens on now and this process has not handed
    out before (another process may still take it: the range is outside the kernel's)."""
    ports = _ports()
    candidates = [p for p in ports if p not in _handed_out]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1}")


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except FileNotFoundError:
        return ""


def _answers(url: str) -> bytes | None:
    """The body of a GET of ``url``, or None when nothing (or an error) answered."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
            return bytes(resp.read())
    except (urllib.error.URLError, OSError):
        return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (after SIGCONT: a stopped process cannot act on it), SIGKILL after the grace."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ProcessExited(RuntimeError):
    """A process we started exited before it was ready."""

    def __init__(self, name: str, returncode: int, log: str) -> None:
        super().__init__(f"{name} exited with {returncode}; its log ends:\n{log}")
        self.returncode = returncode
        self.log = log


class EtcdProcess:
    """A single-member etcd on free loopback ports (client and peer), data in
    ``work_dir/etcd-data``. May be paused (SIGSTOP: connections are accepted, nothing answers),
    killed and started again on the same ports and data."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.data_dir = work_dir / "etcd-data"
        self.log_path = work_dir / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def url(self, prefix: str) -> str:
        """The store URL of ``prefix`` on this server (NODE_METADATA_URL's form)."""
        return f"etcd://127.0.0.1:{self.client_port}/{prefix}"

    def start(self) -> None:
        if not os.access(ETCD_BINARY, os.X_OK):
            raise FileNotFoundError(
                f"{ETCD_BINARY} is missing: run `make tools` (installs Debian's etcd-server)"
            )
        self.work_dir.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    ETCD_BINARY,
                    "--name",
                    "local",
                    "--data-dir",
                    str(self.data_dir),
                    "--listen-client-urls",
                    self.client_url,
                    "--advertise-client-urls",
                    self.client_url,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"local={peer}",
                    "--logger",
                    "zap",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ProcessExited("etcd", self.proc.returncode, _tail(self.log_path))
            body = _answers(self.client_url + "/health")
            if body is not None and b'"true"' in body:
                return
            time.sleep(READY_POLL_S)
        raise RuntimeError(f"etcd not healthy in {READY_TIMEOUT_S} s: {_tail(self.log_path)}")

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: what it had not fsynced is lost, as on a crash."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` (full key, prefix included) by a linearizable read, or None."""
        request = urllib.request.Request(
            self.client_url + "/v3/kv/range",
            data=json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as resp:
            kvs = json.loads(resp.read()).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None


class LocalNode:
    """One node process of the cluster: ``python -m node serve`` with its own data directory
    and port, under the cluster's metadata store."""

    def __init__(self, node_id: str, root: Path, env: Mapping[str, str]) -> None:
        self.id = node_id
        self.data_dir = root / node_id
        self.log_path = root / f"{node_id}.log"
        self.port = free_port()
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Starts the process; ``wait_ready`` waits for it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "node", "serve"],
                env={**self.env, "NODE_DATA_DIR": str(self.data_dir)}
                | {"NODE_HTTP_PORT": str(self.port), "NODE_HTTP_HOST": "127.0.0.1"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, etcd: EtcdProcess | None, prefix: str) -> None:
        """Until /heartbeat answers and, with ``etcd``, ``nodes/<id>`` is registered."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessExited(f"node {self.id}", self.proc.returncode, self.log())
            if _answers(self.url + "/heartbeat") is not None and (
                etcd is None or self._registered(etcd, prefix)
            ):
                return
            time.sleep(READY_POLL_S)
        raise RuntimeError(f"node {self.id} not ready in {READY_TIMEOUT_S} s:\n{self.log()}")

    def _registered(self, etcd: EtcdProcess, prefix: str) -> bool:
        try:
            return etcd.get(f"/{prefix}/{node_key(self.id)}") is not None
        except (urllib.error.URLError, OSError):
            return False

    def signal(self, signum: signal.Signals) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signum)
            if signum == signal.SIGSTOP:
                wait_stopped(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def log(self) -> str:
        return _tail(self.log_path)


class LocalCluster:
    """etcd and ``nodes`` node processes ``n0..n<N-1>`` under ``root``; ``zones`` (one per
    node, optional) become their NODE_ZONE; ``env`` is added to every node's environment (on
    top of this process's). ``register``: wait until each node has registered in etcd, not
    only until it answers /heartbeat."""

    def __init__(
        self,
        root: Path,
        nodes: int = 3,
        zones: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        register: bool = True,
        prefix: str = METADATA_PREFIX,
    ) -> None:
        if zones is not None and len(zones) != nodes:
            raise ValueError(f"{len(zones)} zones for {nodes} nodes")
        self.root = root
        self.prefix = prefix
        self.register = register
        self.etcd = EtcdProcess(root / "etcd")
        base = {**os.environ, **(env or {})}
        base.pop("NODE_CRASH_POINTS", None)  # a leftover of the caller's must not crash them
        self.nodes: dict[str, LocalNode] = {}
        for i in range(nodes):
            node_id = f"n{i}"
            node_env = {**base, "NODE_ID": node_id, "NODE_METADATA_URL": self.metadata_url}
            node_env["NODE_ZONE"] = zones[i] if zones else base.get("NODE_ZONE", "")
            self.nodes[node_id] = LocalNode(node_id, root, node_env)
        root.mkdir(parents=True, exist_ok=True)
        try:
            self.etcd.start()
            for node in self.nodes.values():
                node.start()
            for node in self.nodes.values():
                self._wait(node)
        except BaseException:
            self.close()
            raise

    @property
    def metadata_url(self) -> str:
        return self.etcd.url(self.prefix)

    @property
    def node_ids(self) -> list[str]:
        return list(self.nodes)

    def url(self, node_id: str) -> str:
        return self.nodes[node_id].url

    def node(self, node_id: str) -> LocalNode:
        return self.nodes[node_id]

    def _wait(self, node: LocalNode) -> None:
        node.wait_ready(self.etcd if self.register else None, self.prefix)

    def kill(self, node_id: str) -> None:
        """SIGKILL: a crash (what the node had not fsynced is gone)."""
        self.nodes[node_id].kill()

    def terminate(self, node_id: str) -> None:
        """SIGTERM and wait: a clean stop (the node flushes what it holds in memory to its
        entry logs and revokes its registration)."""
        self.nodes[node_id].stop()

    def stop(self, node_id: str) -> None:
        """SIGSTOP: the node keeps its sockets and answers nothing (a pause, a long GC)."""
        self.nodes[node_id].signal(signal.SIGSTOP)

    def cont(self, node_id: str) -> None:
        self.nodes[node_id].signal(signal.SIGCONT)

    def start(self, node_id: str, env: Mapping[str, str] | None = None) -> None:
        """Starts a node that is down (``env``: extra variables from now on, e.g. NODE_FAULTS)
        and waits until it is ready; ProcessExited if it exits first (a refused start)."""
        node = self.nodes[node_id]
        if node.alive():
            raise RuntimeError(f"node {node_id} is running")
        node.env.update(env or {})
        node.start()
        self._wait(node)

    def restart(self, node_id: str, env: Mapping[str, str] | None = None) -> None:
        """SIGKILL then start again on the same port and data directory."""
        self.kill(node_id)
        self.start(node_id, env)

    def wipe(self, node_id: str) -> None:
        """Kills the node and deletes its data directory (a lost volume)."""
        self.kill(node_id)
        shutil.rmtree(self.nodes[node_id].data_dir, ignore_errors=True)

    def kill_etcd(self) -> None:
        self.etcd.kill()

    def restart_etcd(self) -> None:
        """Starts etcd again on the same ports and data (killing it first if it runs)."""
        self.etcd.restart()

    def close(self) -> None:
        """Stops every node (SIGTERM, so they revoke their registration), then etcd. The nodes
        get their SIGTERM together: one slow to stop does not hold the others' grace."""
        running = [n.proc for n in self.nodes.values() if n.proc is not None and n.alive()]
        for proc in running:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for node in self.nodes.values():
            node.stop()
        self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def wait_stopped(pid: int) -> None:
    """Until the kernel has stopped the child ``pid``: a SIGSTOP is only sent when
    send_signal returns, and a request made right after could still be answered. Spins on
    waitid for stops only (an exit is left for Popen to reap) rather than sleeping: it is
    called from tests' event loops, where a sleep is refused, and a stop takes microseconds
    to a few scheduler slices."""
    deadline = time.monotonic() + STOPPED_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG) is not None:
                return
        except ChildProcessError:
            return  # not our child, or gone: nothing to wait on
        os.sched_yield()
    raise RuntimeError(f"process {pid} not stopped {STOPPED_TIMEOUT_S} s after SIGSTOP")
