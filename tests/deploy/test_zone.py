"""NODE_ZONE on Kubernetes: the StatefulSet's init container, run as the kubelet would run it
(its args from the rendered manifests, $(K8S_NODE_NAME) expanded, paths under a temporary
root) against an HTTP server answering the Node API's GET as the API server does (the
bearer token checked, 403 without it), writes the file the node then reads as its zone. As in
a pod, the in-cluster address comes from KUBERNETES_SERVICE_HOST/PORT and is HTTPS, its
certificate checked against the CA beside the token: one signed by another CA is refused."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 that is its own CA, and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture
def tls_api(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The API server over HTTPS: its port, and the CA certificate that signed it."""
    cert, key = _self_signed(tmp_path, "apiserver")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], cert
    server.shutdown()
    server.server_close()


def _init_container(objects: tuple[Obj, ...]) -> Obj:
    (init,) = only(objects, "StatefulSet")["spec"]["template"]["spec"]["initContainers"]
    return dict(init)


def _run_init(
    overlay: str,
    root: Path,
    api: str | None,
    node_name: str,
    token: str = TOKEN,
    ca: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The init container's command on this machine: (its run, where its file lands).
    ``api`` None: the in-cluster address, from ``env`` as the kubelet sets it; ``ca``: the
    certificate the kubelet puts beside the token."""
    init = _init_container(render(overlay))
    args = [a.replace("$(K8S_NODE_NAME)", node_name) for a in init["args"]]
    output = args[args.index("--output") + 1]
    mapped = root / output.lstrip("/")
    args[args.index("--output") + 1] = str(mapped)
    token_dir = root / "serviceaccount"
    token_dir.mkdir(parents=True, exist_ok=True)
    (token_dir / "token").write_text(token + "\n")
    if ca is not None:
        shutil.copyfile(ca, token_dir / "ca.crt")
    given = [] if api is None else ["--api-url", api]
    done = subprocess.run(
        [sys.executable, "-m", "node", *args, *given, "--token-dir", str(token_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
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


def test_in_a_pod_the_api_server_is_reached_over_https_and_its_certificate_checked(
    tls_api: tuple[int, Path], tmp_path: Path
) -> None:
    """No --api-url, as in the manifests: the address from KUBERNETES_SERVICE_HOST/PORT,
    HTTPS, the server's certificate checked against the service account's ca.crt. The same
    server with another CA in ca.crt is refused (exit 1, the TLS error named), and the
    file is not written."""
    port, ca = tls_api
    in_pod = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}
    node = "ip-10-0-1-5.ec2.internal"
    done, written = _run_init(OVERLAYS[0], tmp_path / "pod", None, node, ca=ca, env=in_pod)
    assert done.returncode == 0, done.stderr
    assert written.read_text() == "eu-west-1b\n"

    other, _key = _self_signed(tmp_path, "another-ca")
    done, written = _run_init(OVERLAYS[0], tmp_path / "bad", None, node, ca=other, env=in_pod)
    assert done.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in done.stderr, done.stderr
    assert not written.exists()
