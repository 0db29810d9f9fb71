"""The rendered manifests: valid Kubernetes objects for the oldest and newest versions we
support, a ServiceMonitor valid against its CRD's schema, and wired to the node as it is
(its settings, its WAL, its shutdown), not to copied constants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from pydantic import TypeAdapter

from node.settings import Settings
from tests.deploy.render import (
    ADDONS,
    KUSTOMIZATIONS,
    OVERLAYS,
    Obj,
    container,
    of_kind,
    only,
    quantity_bytes,
    render,
    resolve_port,
)

OLDEST_VERSION = "1.30"  # the oldest Kubernetes the manifests support (EKS standard support)
KUBERNETES_VERSIONS = (OLDEST_VERSION, kubernetes_validate.latest_version())
SCHEMAS = Path(__file__).parent / "schemas"
# Custom resources have no schema in kubernetes-validate: ours, kept in the repo.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.v1.schema.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.v1.schema.json",
}
SETTING_VARIABLES = {f"NODE_{name.upper()}" for name in Settings.model_fields}
READY_PATH = "/api/v1/bookie/is_ready"
LIVE_PATH = "/heartbeat"


def node_variables(objects: tuple[Obj, ...]) -> dict[str, str]:
    """The NODE_* variables the StatefulSet's container gets from its ConfigMap and `env`
    (a value taken from the pod or a Secret shows as the reference)."""
    statefulset = only(objects, "StatefulSet")
    cont = container(statefulset)
    found: dict[str, str] = {}
    for source in cont.get("envFrom", []):
        config_map = only(objects, "ConfigMap", source["configMapRef"]["name"])
        found.update(config_map["data"])
    for variable in cont.get("env", []):
        if variable["name"].startswith("NODE_"):  # others feed them ($(POD_NAMESPACE))
            found[variable["name"]] = variable.get("value", json.dumps(variable.get("valueFrom")))
    return found


def effective(objects: tuple[Obj, ...], name: str) -> Any:
    """A setting's value in the pod: the manifests' variable, else the node's default."""
    variable = node_variables(objects).get(f"NODE_{name.upper()}")
    if variable is None:
        return Settings.model_fields[name].default
    # parsed by the setting's own type, as the node parses its environment
    return TypeAdapter(Settings.model_fields[name].annotation).validate_python(variable)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_in_strict_mode(directory: str, version: str) -> None:
    objects = render(directory)
    assert objects, f"{directory} renders nothing"
    for obj in objects:
        crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        if crd is not None:
            schema = json.loads((SCHEMAS / crd).read_text())
            jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)
        else:
            # strict: an unknown or misspelt field is an error, not silently dropped
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_crd_schema_refuses_what_prometheus_operator_would() -> None:
    """The kept schema is strict enough to matter: a typo and a bad duration fail it."""
    monitor = only(render("monitoring"), "ServiceMonitor")
    schema = json.loads(
        (SCHEMAS / CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")]).read_text()
    )
    typo = json.loads(json.dumps(monitor))
    typo["spec"]["endpoints"][0]["intervall"] = "30s"
    bad_duration = json.loads(json.dumps(monitor))
    bad_duration["spec"]["endpoints"][0]["interval"] = "30 seconds"
    for wrong in (typo, bad_duration):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema, cls=jsonschema.Draft202012Validator)


def test_the_rule_schema_refuses_what_prometheus_operator_would() -> None:
    """The kept PrometheusRule schema matters: a misspelt rule key, a bad `for` and a rule
    that is neither an alert nor a recording rule fail it."""
    rule = only(render("monitoring"), "PrometheusRule")
    assert rule["spec"]["groups"][0]["rules"], "the PrometheusRule holds no rule"
    schema = json.loads(
        (SCHEMAS / CRD_SCHEMAS[("monitoring.coreos.com/v1", "PrometheusRule")]).read_text()
    )
    typo, bad_for, nameless = (json.loads(json.dumps(rule)) for _ in range(3))
    typo["spec"]["groups"][0]["rules"][0]["anotations"] = {}
    bad_for["spec"]["groups"][0]["rules"][0]["for"] = "2 minutes"
    del nameless["spec"]["groups"][0]["rules"][0]["alert"]
    for wrong in (typo, bad_for, nameless):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_node_variable_is_a_setting_the_node_accepts(overlay: str) -> None:
    # The node ignores an unknown NODE_* variable (pydantic reads only its fields): a typo in
    # a manifest would silently leave the default in force.
    variables = node_variables(render(overlay))
    unknown = sorted(set(variables) - SETTING_VARIABLES)
    assert not unknown, f"{overlay}: not settings of node/settings.py: {unknown}"
    assert variables, f"{overlay}: the pod gets no NODE_* variable"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_no_node_variable_outside_the_statefulset_is_unknown(directory: str) -> None:
    for config_map in of_kind(render(directory), "ConfigMap"):
        keys = {k for k in config_map.get("data", {}) if k.startswith("NODE_")}
        assert keys <= SETTING_VARIABLES, sorted(keys - SETTING_VARIABLES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_shutdown(overlay: str) -> None:
    objects = render(overlay)
    grace = only(objects, "StatefulSet")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    # SIGTERM waits up to shutdown_timeout_s for requests, then checkpoints: the kubelet's
    # SIGKILL must come after both (tests/deploy/test_pod.py measures the checkpoint).
    assert grace > effective(objects, "shutdown_timeout_s")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_statefulset_shape(overlay: str) -> None:
    objects = render(overlay)
    statefulset = only(objects, "StatefulSet")
    spec = statefulset["spec"]
    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()

    headless = only(objects, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    for service in of_kind(objects, "Service"):
        assert service["spec"]["selector"].items() <= pod_labels.items(), service["metadata"]
        for port in service["spec"]["ports"]:
            resolve_port(container(statefulset), port["targetPort"])
    clients = [s for s in of_kind(objects, "Service") if s["spec"].get("clusterIP") != "None"]
    assert len(clients) == 1, "one client Service"

    budget = only(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    assert pod["serviceAccountName"] == only(objects, "ServiceAccount")["metadata"]["name"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [term["topologyKey"] for term in anti] == ["kubernetes.io/hostname"]
    assert anti[0]["labelSelector"]["matchLabels"].items() <= pod_labels.items()

    cont = container(statefulset)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert cont["securityContext"]["readOnlyRootFilesystem"] is True
    assert cont["securityContext"]["allowPrivilegeEscalation"] is False
    assert cont["resources"]["requests"] and cont["resources"]["limits"]["memory"]

    assert cont["startupProbe"]["httpGet"]["path"] == READY_PATH
    assert cont["readinessProbe"]["httpGet"]["path"] == READY_PATH
    assert cont["livenessProbe"]["httpGet"]["path"] == LIVE_PATH
    http_port = effective(objects, "http_port")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert resolve_port(cont, cont[probe]["httpGet"]["port"]) == http_port, probe


def _claims(statefulset: Obj) -> dict[str, Obj]:
    return {c["metadata"]["name"]: c for c in statefulset["spec"]["volumeClaimTemplates"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_are_wired_to_the_settings(overlay: str) -> None:
    objects = render(overlay)
    statefulset = only(objects, "StatefulSet")
    cont = container(statefulset)
    claims = _claims(statefulset)
    volumes = {v["name"] for v in statefulset["spec"]["template"]["spec"].get("volumes", [])}
    mounts = {m["name"]: m["mountPath"] for m in cont.get("volumeMounts", [])}
    devices = {d["name"]: d["devicePath"] for d in cont.get("volumeDevices", [])}
    # Every claim is used, and used as what it is: a Block claim only as a device.
    assert set(claims) <= set(mounts) | set(devices), "a claim no container uses"
    assert set(mounts) | set(devices) <= set(claims) | volumes
    for name, claim in claims.items():
        block = claim["spec"].get("volumeMode") == "Block"
        assert (name in devices) == block, f"claim {name}: volumeMode and use disagree"

    data_dir = effective(objects, "data_dir")
    assert str(data_dir) in mounts.values(), "NODE_DATA_DIR is not a volume"
    if effective(objects, "wal_kind") == "blockdev":
        wal_path = str(effective(objects, "wal_path"))
        by_path = {path: name for name, path in devices.items()}
        assert wal_path in by_path, f"NODE_WAL_PATH {wal_path} is no volumeDevices devicePath"
        size = quantity_bytes(claims[by_path[wal_path]]["spec"]["resources"]["requests"]["storage"])
        # The ring refuses a device smaller than its capacity.
        assert effective(objects, "wal_capacity") <= size
    else:
        assert not devices, "a raw device the file journal does not use"
        assert f"{data_dir}/journal" in mounts.values(), "the file journal has no volume"


def test_aws_overlay_puts_every_volume_on_gp3_at_the_wal_rate() -> None:
    objects = render("overlays/aws")
    storage_class = only(objects, "StorageClass")
    params = storage_class["parameters"]
    assert storage_class["provisioner"] == "ebs.csi.aws.com"
    assert params["type"] == "gp3"
    assert storage_class["volumeBindingMode"] == "WaitForFirstConsumer"
    # The raw WAL writes at most wal_write_rate_limit blocks per second: each one an I/O the
    # volume must be provisioned for.
    assert int(params["iops"]) >= effective(objects, "wal_write_rate_limit") > 0
    assert effective(objects, "wal_kind") == "blockdev"
    for name, claim in _claims(only(objects, "StatefulSet")).items():
        assert claim["spec"]["storageClassName"] == storage_class["metadata"]["name"], name
    assert effective(objects, "offload_store") == "s3"
    assert effective(objects, "offload_bucket")


def test_local_overlay_uses_the_file_journal_and_the_default_storage_class() -> None:
    objects = render("overlays/local")
    assert effective(objects, "wal_kind") == "journal"
    assert not of_kind(objects, "StorageClass")
    for name, claim in _claims(only(objects, "StatefulSet")).items():
        assert "storageClassName" not in claim["spec"], name
    assert effective(objects, "offload_store") == "local"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_one_service_on_a_named_port(overlay: str) -> None:
    monitor = only(render("monitoring"), "ServiceMonitor")
    objects = render(overlay)
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        s
        for s in of_kind(objects, "Service")
        if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert len(selected) == 1, "each target would be scraped once per selected Service"
    assert monitor["metadata"]["namespace"] == selected[0]["metadata"]["namespace"]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names


def _allows(
    objects: tuple[Obj, ...], subject: str, verb: str, resource: str, scope: str = ""
) -> bool:
    """Whether a RoleBinding (``scope="Cluster"``: a ClusterRoleBinding) gives service
    account ``subject`` ``verb`` on ``resource``."""
    roles = {r["metadata"]["name"]: r for r in of_kind(objects, f"{scope}Role")}
    for binding in of_kind(objects, f"{scope}RoleBinding"):
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == subject for s in binding["subjects"]
        ):
            continue
        for rule in roles[binding["roleRef"]["name"]]["rules"]:
            if verb in rule["verbs"] and resource in rule["resources"]:
                return True
    return False


def test_airflow_may_list_pods_and_nothing_more() -> None:
    objects = render("airflow")
    for verb in ("get", "list", "watch"):
        assert _allows(objects, "airflow-worker", verb, "pods")
    for verb in ("create", "delete", "patch"):
        assert not _allows(objects, "airflow-worker", verb, "pods")


def test_spark_driver_may_manage_its_executors() -> None:
    objects = render("spark")
    account = only(objects, "ServiceAccount")["metadata"]["name"]
    for resource in ("pods", "services", "configmaps"):
        for verb in ("create", "get", "list", "watch", "delete"):
            assert _allows(objects, account, verb, resource), (verb, resource)


@pytest.mark.parametrize("addon", ADDONS)
def test_addons_share_the_nodes_namespace(addon: str) -> None:
    namespaces = {
        o["metadata"]["namespace"] for o in render("overlays/aws") if "namespace" in o["metadata"]
    }
    for obj in render(addon):
        assert obj["metadata"].get("namespace") in namespaces, obj["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_identity_and_metadata_store_are_wired(overlay: str) -> None:
    """NODE_ID is the pod's name (stable, never its IP); the advertised URL is that name under
    the headless Service on the node's port; NODE_METADATA_URL lists every etcd member by its
    name under etcd's headless Service, on its client port."""
    objects = render(overlay)
    statefulset = only(objects, "StatefulSet")
    cont = container(statefulset)
    env = {v["name"]: v for v in cont["env"]}
    assert env["NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    names = [v["name"] for v in cont["env"]]
    advertised = env["NODE_ADVERTISED_URL"]["value"]
    # $(NAME) expands only names defined before it
    assert names.index("NODE_ID") < names.index("NODE_ADVERTISED_URL")
    assert names.index("POD_NAMESPACE") < names.index("NODE_ADVERTISED_URL")
    headless = statefulset["spec"]["serviceName"]
    assert advertised == (
        f"http://$(NODE_ID).{headless}.$(POD_NAMESPACE).svc.cluster.local:"
        f"{effective(objects, 'http_port')}"
    )

    etcd = render("etcd")
    members = only(etcd, "StatefulSet")
    etcd_headless = only(etcd, "Service", members["spec"]["serviceName"])
    assert etcd_headless["spec"]["clusterIP"] == "None"
    client_port = resolve_port(container(members), "client")
    replicas = members["spec"]["replicas"]
    assert replicas == 3
    expected = ",".join(
        f"{members['metadata']['name']}-{i}.{etcd_headless['metadata']['name']}:{client_port}"
        for i in range(replicas)
    )
    url = node_variables(objects)["NODE_METADATA_URL"]
    assert url == f"etcd://{expected}/storage"
    from node.client.metadata.etcd import parse_url

    endpoints, prefix = parse_url(url)
    assert len(endpoints) == replicas and prefix == "/storage/"
    args = " ".join(container(members)["args"])
    for i in range(replicas):
        assert f"{members['metadata']['name']}-{i}=http://" in args
    assert only(etcd, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_zone_reader_may_get_nodes_and_nothing_more(overlay: str) -> None:
    """The pods' service account may get a Node (the zone init container's one GET), bound
    in the namespace the pods run in; it may not list nodes nor touch anything else."""
    objects = render(overlay)
    account = only(objects, "ServiceAccount")
    name = account["metadata"]["name"]
    assert only(objects, "StatefulSet")["spec"]["template"]["spec"]["serviceAccountName"] == name
    assert _allows(objects, name, "get", "nodes", scope="Cluster")
    for verb in ("list", "watch", "patch", "update", "delete"):
        assert not _allows(objects, name, verb, "nodes", scope="Cluster"), verb
    for resource in ("pods", "secrets", "configmaps"):
        assert not _allows(objects, name, "get", resource, scope="Cluster"), resource
        assert not _allows(objects, name, "get", resource), resource
    (binding,) = of_kind(objects, "ClusterRoleBinding")
    (subject,) = binding["subjects"]
    assert subject["namespace"] == account["metadata"]["namespace"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_zone_init_container_holds_a_token(overlay: str) -> None:
    """The node serves HTTP for as long as it runs: it gets no Kubernetes credential. The
    init container mounts the token explicitly, and shares the zone file with the node."""
    objects = render(overlay)
    statefulset = only(objects, "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert only(objects, "ServiceAccount")["automountServiceAccountToken"] is False
    (init,) = pod["initContainers"]
    node = container(statefulset)
    assert init["image"] == node["image"]  # the node's own code: python -m node zone
    token_volumes = {
        v["name"]
        for v in pod["volumes"]
        if any(
            "serviceAccountToken" in source for source in v.get("projected", {}).get("sources", [])
        )
    }
    assert {m["name"] for m in init["volumeMounts"]} & token_volumes
    assert not {m["name"] for m in node["volumeMounts"]} & token_volumes
    env = {v["name"]: v for v in init["env"]}
    assert env["K8S_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "$(K8S_NODE_NAME)" in init["args"]
    output = init["args"][init["args"].index("--output") + 1]
    assert node_variables(objects)["NODE_ZONE_FILE"] == output
    # The same emptyDir in both, read-only in the node.
    (written,) = [m for m in init["volumeMounts"] if output.startswith(m["mountPath"] + "/")]
    (read,) = [m for m in node["volumeMounts"] if output.startswith(m["mountPath"] + "/")]
    assert written["name"] == read["name"] and read["readOnly"] is True
    volume = {v["name"]: v for v in pod["volumes"]}[read["name"]]
    assert "emptyDir" in volume
