"""``python -m node zone``: the zone of the Kubernetes node a pod runs on, for NODE_ZONE.

The zone is the node's ``topology.kubernetes.io/zone`` label, and the downward API gives a
pod its own fields and labels, never its node's. So the StatefulSet's init container (the
node's image) reads the Node object from the API server with the pod's service account
token (a ClusterRole that may only ``get nodes``) and writes the label to a file on an
emptyDir; the node reads it at start (``zone_file``). Only the init container mounts a
token: the node, which serves HTTP for as long as it runs, holds no Kubernetes credential.

Plain HTTPS with the standard library (the API server's address from the variables the
kubelet sets in every container, its CA beside the token): the image carries no Kubernetes
client for one GET.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

ZONE_LABEL = "topology.kubernetes.io/zone"
# Where the token volume is mounted in the init container (the kubelet's usual place).
TOKEN_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


class ZoneError(Exception):
    """The Node object could not be read; the message says what to check."""


def api_url() -> str:
    """The in-cluster API server, from the variables the kubelet sets in every container."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ZoneError("KUBERNETES_SERVICE_HOST is not set: not in a Kubernetes pod?")
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{port}"


def node_zone(node_name: str, base_url: str, token_dir: Path = TOKEN_DIR) -> str:
    """The node's zone label, or "" when it has none (a cluster without zones)."""
    try:
        token = (token_dir / "token").read_text().strip()
    except OSError as error:
        raise ZoneError(f"no service account token in {token_dir}: {error.strerror}") from None
    context = None
    if base_url.startswith("https://"):
        context = ssl.create_default_context(cafile=str(token_dir / "ca.crt"))
    url = f"{base_url.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node_name, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as reply:
            node = json.loads(reply.read())
    except urllib.error.HTTPError as error:
        hint = (
            " (the pod's service account needs a ClusterRole that may get nodes)"
            if error.code == 403
            else ""
        )
        raise ZoneError(f"GET {url}: {error.code} {error.reason}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ZoneError(f"GET {url}: {error}") from None
    labels = (node.get("metadata") or {}).get("labels") or {}
    return str(labels.get(ZONE_LABEL, ""))


def write_zone(path: Path, zone: str) -> None:
    """Atomically: the node never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(zone + "\n")
    partial.replace(path)


def run(node_name: str, output: Path, base_url: str | None, token_dir: Path) -> int:
    try:
        zone = node_zone(node_name, base_url or api_url(), token_dir)
    except ZoneError as error:
        log.error("zone of node %s not read: %s", node_name, error)
        return 1
    if not zone:
        log.warning("node %s has no %s label: placement sees one zone", node_name, ZONE_LABEL)
    write_zone(output, zone)
    log.info("node %s is in zone %r (written to %s)", node_name, zone, output)
    return 0
