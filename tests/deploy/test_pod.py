"""The node started as each overlay's StatefulSet starts it, probed on every path and port the
manifests name (probes, Services, ServiceMonitor), and stopped with SIGTERM within the grace
period."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.pod import ADMIN_TOKEN, NO_METADATA_STORE, POD_ZONE, pod_environment
from tests.deploy.podrun import POD_IP, PROBE_OK, PodSpec, Probe, run_pod
from tests.deploy.render import OVERLAYS, REPO, container, of_kind, only, render, resolve_port

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SERVICE_CHECK_PATH = "/heartbeat"  # a Service names a port only; this path answers on any
SETTINGS_PATH = "/api/v1/config/server_config"  # what the node made of its environment
# A start with a fresh WAL takes seconds; this bounds a hang, not the speed.
READY_TIMEOUT_S = 60.0
# Written before SIGTERM: a write cache for the final checkpoint to flush (16 MiB).
WRITES = 256
WRITE_SIZE = 64 * 1024
CLUSTER_DOMAIN = "cluster.local"
FOREIGN_HOST = "evil.example"  # a name rebound to the pod's IP by a hostile page


def _service_hosts(objects: tuple[dict[str, Any], ...], port: int) -> list[str]:
    """Every Host a client of a Service sends: its name, with or without the namespace and
    the cluster domain; for the headless Service, the first pod's name under it too."""
    statefulset = only(objects, "StatefulSet")
    namespace = statefulset["metadata"].get("namespace", "default")
    hosts = []
    for service in of_kind(objects, "Service"):
        name = service["metadata"]["name"]
        bases = [name]
        if service["spec"].get("clusterIP") == "None":
            bases.append(f"{statefulset['metadata']['name']}-0.{name}")
        for base in bases:
            for suffix in (
                "",
                f".{namespace}",
                f".{namespace}.svc",
                f".{namespace}.svc.{CLUSTER_DOMAIN}",
            ):
                hosts.append(f"{base}{suffix}:{port}")
    return hosts


def _entrypoint() -> list[str]:
    """The image's ENTRYPOINT, with this interpreter for its python."""
    parser = DockerfileParser(str(REPO / "Dockerfile"))
    command = [i["value"] for i in parser.structure if i["instruction"] == "ENTRYPOINT"]
    argv: list[str] = json.loads(command[-1])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


def _image_env() -> dict[str, str]:
    return dict(DockerfileParser(str(REPO / "Dockerfile")).envs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_answers_every_probe_the_manifests_name(overlay: str, tmp_path: Path) -> None:
    objects = render(overlay)
    statefulset = only(objects, "StatefulSet")
    cont = container(statefulset)
    ready = cont["startupProbe"]["httpGet"]
    # The kubelet, Prometheus (through the endpoints) and Airflow connect to the pod's IP.
    probes = [
        Probe(resolve_port(cont, cont[p]["httpGet"]["port"]), cont[p]["httpGet"]["path"], POD_IP)
        for p in PROBES
    ]
    for service in of_kind(objects, "Service"):
        for port in service["spec"]["ports"]:
            target = resolve_port(cont, port["targetPort"])
            probes.append(Probe(target, SERVICE_CHECK_PATH, POD_IP))
            for host in _service_hosts(objects, port["port"]):
                probes.append(Probe(target, SERVICE_CHECK_PATH, POD_IP, host))
    monitor = only(render("monitoring"), "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for service in of_kind(objects, "Service"):
        if selector.items() <= service["metadata"]["labels"].items():
            by_name = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                port = resolve_port(cont, by_name[endpoint["port"]])
                probes.append(Probe(port, endpoint["path"], POD_IP))
    http_port = resolve_port(cont, ready["port"])
    refused = Probe(http_port, SERVICE_CHECK_PATH, POD_IP, f"{FOREIGN_HOST}:{http_port}")
    probes.append(refused)
    probes.append(Probe(http_port, SETTINGS_PATH, token=True))

    with pod_environment(objects, _image_env(), tmp_path / "root") as env:
        env.update(NO_METADATA_STORE)
        report = run_pod(
            PodSpec(
                argv=[*_entrypoint(), *cont["args"]],
                env=env,
                cwd=str(REPO),
                log=str(tmp_path / "node.log"),
                ready=Probe(http_port, ready["path"]),
                probes=probes,
                ready_timeout_s=READY_TIMEOUT_S,
                writes=WRITES,
                write_size=WRITE_SIZE,
                token=ADMIN_TOKEN,
            )
        )
        assert report["ready"], f"never ready; node log:\n{report['log']}"
        *answered, foreign, settings = report["probes"]
        for seen in [*answered, settings]:
            assert seen["status"] in PROBE_OK, (seen, report["log"])
        assert foreign["status"] == 403 and "host_not_allowed" in foreign["body"], foreign
        config = json.loads(settings["body"])
        # The node runs on what the manifests give it, not on its defaults.
        assert config["http_host"] == env["NODE_HTTP_HOST"]
        assert config["http_port"] == int(env["NODE_HTTP_PORT"])
        assert config["wal_kind"] == env["NODE_WAL_KIND"]
        if config["wal_kind"] == "blockdev":
            assert config["wal_path"] == env["NODE_WAL_PATH"]
            assert env["NODE_WAL_PATH"].startswith("/dev/loop")
        assert config["node_id"] == int(env["NODE_NODE_ID"])
        assert config["id"] == f"{statefulset['metadata']['name']}-0" == env["NODE_ID"]
        assert config["metadata_url"] == env["NODE_METADATA_URL"]
        assert config["zone"] == POD_ZONE  # read from the init container's file
        assert config["admin_token"] == "******"
        assert config["offload_store"] == env.get("NODE_OFFLOAD_STORE", "local")
        # The Secret's token guards writes; with it they succeed.
        assert report["writes"] == {"without_token": 401, "create": 201, "adds": [201]}

    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert report["exit_code"] == 0, report["log"]
    assert "stopped cleanly" in report["log"]
    assert report["stop_s"] < grace, "the kubelet would SIGKILL before the final checkpoint"
