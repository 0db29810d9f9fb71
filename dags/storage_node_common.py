"""What the storage-node DAGs share: finding the nodes, and talking to one node's admin API.

Kept light on purpose: the DAG processor imports every DAG file often, so nothing here loads
RocksDB, PySpark or the Kubernetes client at import time (the client is imported only when a
discovery of kind "kubernetes" runs). The HTTP client is the standard library's: a node's admin
API is a handful of small JSON calls, and urllib needs no extra package in the Airflow image.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

DISCOVERY_VARIABLE = "storage_node_discovery"
METADATA_VARIABLE = "storage_node_metadata"  # the autorecovery DAG's
CONNECTION_ID = "storage_node"  # its password is the node's admin bearer token
DEFAULT_LABEL_SELECTOR = "app.kubernetes.io/name=storage-node"
DEFAULT_PORT = 8080
REQUEST_TIMEOUT_S = 30.0

# Every task: bounded retries with exponential backoff (a node restarting, a rolling update)
# and an execution timeout, so that a hung node never holds a worker slot for ever.
DEFAULT_ARGS: dict[str, Any] = {
    "owner": "storage",
    "retries": 3,
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=10),
    "execution_timeout": timedelta(minutes=30),
}
TAGS = ["storage-node"]


class NodeError(RuntimeError):
    """A node could not do what was asked; the message names the node."""


# What to set, said by a run that finds a Variable missing.
VARIABLE_HINTS = {
    DISCOVERY_VARIABLE: 'the nodes to work on, e.g. {"kind": "static", "urls": '
    '["http://127.0.0.1:8080"]} (docs/deploying.md, "Airflow")',
    METADATA_VARIABLE: "the metadata store's URL as the nodes have it (their NODE_METADATA_URL, "
    "e.g. etcd://127.0.0.1:2379/storage)",
}


def required_variable(name: str, *, deserialize_json: bool = False) -> Any:
    """The Variable ``name``. Without it the task fails at once, without its retries: only an
    operator can set it, and a run retrying with backoff would hold the DAG's one active run
    for the better part of an hour. The message says what to set, and how."""
    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowFailException

    value = Variable.get(name, default=None, deserialize_json=deserialize_json)
    if value is None:
        raise AirflowFailException(
            f"Variable {name} is not set: set it to {VARIABLE_HINTS[name]}, with `airflow "
            f"variables set {name} VALUE` (or the environment variable AIRFLOW_VAR_"
            f"{name.upper()}); `make airflow` sets it for a running `make cluster` "
            "(or AIRFLOW_CLUSTER=DIR)"
        )
    return value


# --- discovery ---------------------------------------------------------------------------------


def discover(config: dict[str, Any]) -> list[str]:
    """The base URLs of the nodes to work on, from the storage_node_discovery Variable's value:
    {"kind": "static", "urls": [...]} or {"kind": "kubernetes", "namespace": ...,
    "labelSelector": ..., "port": ...} (optional "host": an API server URL, or "kubeconfig":
    a file; by default the in-cluster configuration, then ~/.kube/config)."""
    kind = config.get("kind")
    if kind == "static":
        urls = config.get("urls")
        if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"static discovery needs a list of URLs in 'urls', got {urls!r}")
        found = [u.rstrip("/") for u in urls]
    elif kind == "kubernetes":
        found = _discover_pods(config)
    else:
        raise ValueError(f"unknown discovery kind {kind!r} (expected 'static' or 'kubernetes')")
    if not found:
        # An empty fleet is a misconfiguration (a wrong selector), not "nothing to do".
        raise ValueError(f"discovery {config!r} found no node")
    # Sorted, so that map index N is the same node from one run to the next.
    return sorted(set(found))


def _discover_pods(config: dict[str, Any]) -> list[str]:
    from kubernetes import client  # only when asked for: it is heavy
    from kubernetes import config as kube_config

    namespace = config.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("kubernetes discovery needs a 'namespace'")
    selector = config.get("labelSelector", DEFAULT_LABEL_SELECTOR)
    port = int(config.get("port", DEFAULT_PORT))
    if "host" in config:
        configuration = client.Configuration()
        configuration.host = config["host"]
        api_client = client.ApiClient(configuration)
    elif "kubeconfig" in config:
        api_client = kube_config.new_client_from_config(config_file=config["kubeconfig"])
    else:
        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        api_client = client.ApiClient()
    with api_client:
        pods = client.CoreV1Api(api_client).list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT_S
        )
    urls = []
    for pod in pods.items:
        name = pod.metadata.name
        if not _ready(pod):
            # Logged, not an error: a pod starting or being replaced is normal in a fleet.
            log.info("pod %s/%s is not Ready: left out of this run", namespace, name)
            continue
        urls.append(f"http://{pod.status.pod_ip}:{port}")
        log.info("pod %s/%s is Ready at %s", namespace, name, urls[-1])
    return urls


def _ready(pod: Any) -> bool:
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None or not status.pod_ip:
        return False
    if status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


# --- one node's admin API ----------------------------------------------------------------------


class NodeClient:
    """JSON calls to one node; every failure raises NodeError naming the node."""

    def __init__(self, url: str, token: str | None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise NodeError(f"node {self.url}: {method} {path} answered {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise NodeError(f"node {self.url} is unreachable ({method} {path}: {reason})") from e
        if reply.headers.get_content_type() == "application/json":
            return json.loads(raw)
        return raw.decode(errors="replace")

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.call("GET", "/api/v1/bookie/state")
        return state

    def require_writable(self) -> None:
        """Fail naming the node when it cannot do maintenance that writes (compaction copies
        live entries into new logs, offload records its progress)."""
        state = self.state()
        if state.get("readOnly"):
            raise NodeError(f"node {self.url} is read-only: {state}")
        if state.get("shuttingDown"):
            raise NodeError(f"node {self.url} is shutting down: {state}")

    def gc_details(self) -> dict[str, Any]:
        details: list[dict[str, Any]] = self.call("GET", "/api/v1/bookie/gc_details")
        return details[0]

    def reclaimed_bytes(self) -> dict[str, float]:
        """storage_node_gc_reclaimed_bytes_total by "deletion" and "compaction", from /metrics
        (the counter gc_details does not carry)."""
        text = self.call("GET", "/metrics")
        found: dict[str, float] = {}
        for match in _RECLAIMED.finditer(text):
            found[match.group(1)] = float(match.group(2))
        return found


_RECLAIMED = re.compile(
    r'^storage_node_gc_reclaimed_bytes_total\{by="(\w+)"\}\s+(\S+)$', re.MULTILINE
)


def admin_token() -> str | None:
    """The admin bearer token: the password of the Airflow connection storage_node (never in
    DAG code). A missing connection means no token: a node that wants one answers 401, and the
    task fails saying so."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    try:
        conn = Connection.get(CONNECTION_ID)
    except (AirflowNotFoundException, AirflowRuntimeError):
        log.warning("no Airflow connection %r: calling the nodes without a token", CONNECTION_ID)
        return None
    return conn.password or None


def node_client(url: str) -> NodeClient:
    return NodeClient(url, admin_token())


def wait_for_gc(node: NodeClient, timeout_s: float, poll_s: float = 1.0) -> dict[str, Any]:
    """Poll gc_details until the forced run is over (forceCompacting false), or fail naming
    the node once timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        details = node.gc_details()
        if not details["forceCompacting"]:
            return details
        if time.monotonic() >= deadline:
            raise NodeError(
                f"node {node.url}: garbage collection still running after {timeout_s:.0f} s "
                f"(compacting log {details.get('compactingLog')}, "
                f"{details.get('compactingBytesLeft')} bytes left)"
            )
        time.sleep(poll_s)
