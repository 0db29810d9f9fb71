"""A process as a pod runs it: in a network namespace of its own, where it may listen on the
port and the interfaces its manifest names (0.0.0.0:8080) without meeting anything else on
this machine, probed on that port as the kubelet probes it, then stopped with SIGTERM.

``run_pod`` (in the test process) starts ``python -m tests.deploy.podrun SPEC`` under
``unshare --net`` (root); that process brings the namespace's loopback up, runs the pod's
command and reports what each probe and check saw as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.1
PROBE_TIMEOUT_S = 5.0  # one HTTP probe (the liveness probe's timeoutSeconds)
RUNNER_MARGIN_S = 120.0  # the probes and writes of a run; bounds a hang only
# The kubelet counts an HTTP probe as passed for any status in [200, 400).
PROBE_OK = range(200, 400)
NETNS = "/proc/self/ns/net"
BODY_LIMIT = 1 << 20  # enough for /metrics and the settings, bounded all the same


# The pod's IP in its namespace (on its loopback interface: a dummy one needs a kernel module
# a container may lack): the kubelet's probes, Prometheus and Airflow connect to it, and
# name it in Host.
POD_IP = "10.244.0.7"


@dataclass
class Probe:
    port: int
    path: str
    address: str = "127.0.0.1"  # where it connects
    host: str | None = None  # the Host header it sends; None: address:port
    token: bool = False  # sends the admin token (a client, not the kubelet)


@dataclass
class PodSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str
    ready: Probe  # polled until it passes: the startup probe
    probes: list[Probe]  # each called once when ready
    # Entries added before SIGTERM, so that the final checkpoint has a write cache to flush;
    # with the admin token (Bearer) when the node has one.
    writes: int = 0
    write_size: int = 0
    token: str | None = None
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 120.0


def _get(probe: Probe, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{probe.address}:{probe.port}{probe.path}")
    if probe.host is not None:
        request.add_header("Host", probe.host)
    if probe.token and token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
            return int(response.status), response.read(BODY_LIMIT).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read(BODY_LIMIT).decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


def _send(port: int, method: str, path: str, body: bytes, token: str | None) -> int:
    headers = {"Content-Type": "application/octet-stream"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _write(spec: PodSpec, ledger: int) -> dict[str, Any]:
    """Create a ledger (without, then with the token) and add ``spec.writes`` entries."""
    port, path = spec.ready.port, f"/api/v1/ledgers/{ledger}"
    seen: dict[str, Any] = {"without_token": _send(port, "PUT", path, b"", None)}
    seen["create"] = _send(port, "PUT", path, b"", spec.token)
    payload = os.urandom(spec.write_size)
    seen["adds"] = sorted(
        {_send(port, "POST", f"{path}/entries", payload, spec.token) for _ in range(spec.writes)}
    )
    return seen


def _run(spec: PodSpec) -> dict[str, Any]:
    report: dict[str, Any] = {"ready": False, "probes": []}
    with open(spec.log, "ab") as log:
        proc = subprocess.Popen(
            spec.argv, env=spec.env, cwd=spec.cwd, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + spec.ready_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            status, _ = _get(spec.ready)
            if status in PROBE_OK:
                report["ready"] = True
                break
            time.sleep(POLL_S)
        if not report["ready"]:
            report["exit_before_ready"] = proc.poll()
            return report
        for probe in spec.probes:
            status, body = _get(probe, spec.token)
            report["probes"].append({**asdict(probe), "status": status, "body": body})
        if spec.writes:
            report["writes"] = _write(spec, ledger=1)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        report["exit_code"] = proc.wait(spec.stop_timeout_s)
        report["stop_s"] = time.monotonic() - started
        return report
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_pod(spec: PodSpec) -> dict[str, Any]:
    """Run ``spec`` in a new network namespace; what its probes saw (see ``_run``)."""
    spec_path = Path(spec.log).with_suffix(".spec.json")
    # The runner checks that it is not in this namespace before it binds anything.
    spec_path.write_text(json.dumps({**asdict(spec), "host_netns": os.readlink(NETNS)}))
    done = subprocess.run(
        [
            "unshare",
            "--net",
            "--",
            "sh",
            "-c",
            f"ip link set lo up && ip address add {POD_IP}/32 dev lo && "
            'exec "$0" -m tests.deploy.podrun "$1"',
            sys.executable,
            str(spec_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=spec.ready_timeout_s + spec.stop_timeout_s + RUNNER_MARGIN_S,
        check=False,
    )
    log = Path(spec.log).read_text(errors="replace")[-4000:] if Path(spec.log).exists() else ""
    assert done.returncode == 0, f"pod runner failed: {done.stderr}\nnode log:\n{log}"
    report: dict[str, Any] = json.loads(done.stdout)
    report["log"] = log
    return report


def main(spec_path: str) -> int:
    raw = json.loads(Path(spec_path).read_text())
    # Only in the namespace made by run_pod: it must not listen on the host's network.
    assert os.readlink(NETNS) != raw.pop("host_netns"), "not in a network namespace of its own"
    raw["ready"] = Probe(**raw["ready"])
    raw["probes"] = [Probe(**p) for p in raw["probes"]]
    sys.stdout.write(json.dumps(_run(PodSpec(**raw))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
