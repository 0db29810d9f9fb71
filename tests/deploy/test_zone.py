"""NODE_ZONE on Kubernetes: the StatefulSet's init container, run as the kubelet would run it
(its args from the rendered manifests, $(K8S_NODE_NAME) expanded, paths under a temporary
root) against an HTTP server answering the Node API's GET as the API server does (the
bearer token checked, 403 without it), writes the file the node then reads as its zone."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from node.kubezone import ZONE_LABEL
from node.settings import Settings
from tests.deploy.render import OVERLAYS, Obj, only, render

TOKEN = "token-of-the-pod"
NODES = {
    "ip-10-0-1-5.ec2.internal": {ZONE_LABEL: "eu-west-1b", "kubernetes.io/os": "linux"},
    "kind-worker": {"kubernetes.io/os": "linux"},  # a cluster without zones
}


class _ApiServer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(403, {"kind": "Status", "reason": "Forbidden"})
        prefix = "/api/v1/nodes/"
        name = self.path.removeprefix(prefix)
        if not self.path.startswith(prefix) or name not in NODES:
            return self._reply(404, {"kind": "Status", "reason": "NotFound"})
        node = {"kind": "Node", "metadata": {"name": name, "labels": NODES[name]}}
        self._reply(200, node)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _init_container(objects: tuple[Obj, ...]) -> Obj:
    (init,) = only(objects, "StatefulSet")["spec"]["template"]["spec"]["initContainers"]
    return dict(init)


def _run_init(
    overlay: str, root: Path, api: str, node_name: str, token: str = TOKEN
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The init container's command on this machine: (its run, where its file lands)."""
    init = _init_container(render(overlay))
    args = [a.replace("$(K8S_NODE_NAME)", node_name) for a in init["args"]]
    output = args[args.index("--output") + 1]
    mapped = root / output.lstrip("/")
    args[args.index("--output") + 1] = str(mapped)
    token_dir = root / "serviceaccount"
    token_dir.mkdir(parents=True, exist_ok=True)
    (token_dir / "token").write_text(token + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "node", *args, "--api-url", api, "--token-dir", str(token_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done, mapped


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_node_gets_the_zone_label_of_its_kubernetes_node(
    overlay: str, api: str, tmp_path: Path
) -> None:
    done, written = _run_init(overlay, tmp_path, api, "ip-10-0-1-5.ec2.internal")
    assert done.returncode == 0, done.stderr
    assert written.read_text() == "eu-west-1b\n"
    # What the node makes of it at start (NODE_ZONE_FILE, as the StatefulSet sets it).
    assert Settings(zone_file=written).zone == "eu-west-1b"
    assert Settings(zone_file=written, zone="set-by-hand").zone == "set-by-hand"


def test_a_node_without_the_label_gives_one_zone(api: str, tmp_path: Path) -> None:
    done, written = _run_init(OVERLAYS[0], tmp_path, api, "kind-worker")
    assert done.returncode == 0, done.stderr
    assert written.read_text() == "\n" and Settings(zone_file=written).zone == ""
    assert ZONE_LABEL in done.stderr  # the warning names the missing label


def test_without_the_rbac_the_init_container_fails_and_the_node_would_not_start(
    api: str, tmp_path: Path
) -> None:
    """A token the API server refuses (no ClusterRole bound): the init container exits 1
    naming the ClusterRole, writes nothing, and a node given the missing file refuses to
    start rather than run without its zone."""
    done, written = _run_init(OVERLAYS[0], tmp_path, api, "kind-worker", token="other")
    assert done.returncode == 1
    assert "403" in done.stderr and "ClusterRole" in done.stderr
    assert not written.exists()
    with pytest.raises(ValueError, match="zone_file"):
        Settings(zone_file=written)


def test_a_node_unknown_to_the_api_server_fails(api: str, tmp_path: Path) -> None:
    done, written = _run_init(OVERLAYS[0], tmp_path, api, "no-such-node")
    assert done.returncode == 1 and "404" in done.stderr and not written.exists()
