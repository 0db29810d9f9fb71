"""The environment a pod of the rendered StatefulSet gives the node, made real on this machine:
the image's ENV, then the ConfigMap, then the container's `env`; every path the node writes
mapped under a temporary root (the container's root file system is read-only, so each must
be on a volume), each raw block volume a loop device of the claim's size."""

from __future__ import annotations

import os
import re
import subprocess
import typing
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath

import pytest

from node.kubezone import write_zone
from node.settings import Settings
from tests.deploy.render import Obj, container, only, quantity_bytes
from tests.harness.hostdisk import HOST_DISK_NEUTRAL, as_env

LOSETUP_TIMEOUT_S = 30.0
POD_INDEX = "0"  # the first pod of the StatefulSet
ADMIN_TOKEN = "token-from-the-secret"
POD_ZONE = "zone-of-the-pod"  # what the zone init container would have written
# The pod's network (a namespace of its own, podman's) reaches no etcd here: these tests run
# the node without its metadata store. The manifests' identity and store wiring is checked in
# test_manifests.py; the node's with a real etcd in tests/replication/.
NO_METADATA_STORE = {"NODE_METADATA_URL": ""}
# Settings whose values are paths inside the container.
PATH_SETTINGS = {
    f"NODE_{name.upper()}"
    for name, field in Settings.model_fields.items()
    if field.annotation is Path or Path in typing.get_args(field.annotation)
}


@contextmanager
def sparse_loop_device(backing: Path, size: int) -> Iterator[Path]:
    """A loop device over a sparse file: a raw volume of the claim's size that costs only
    what the node writes to it."""
    with open(backing, "wb") as f:
        f.truncate(size)
    made = subprocess.run(
        ["losetup", "--find", "--show", str(backing)],
        capture_output=True,
        text=True,
        timeout=LOSETUP_TIMEOUT_S,
        check=False,
    )
    if made.returncode != 0:
        pytest.fail(f"no loop device (root and util-linux are needed): {made.stderr.strip()}")
    device = Path(made.stdout.strip())
    try:
        yield device
    finally:
        subprocess.run(["losetup", "--detach", str(device)], timeout=LOSETUP_TIMEOUT_S, check=False)


def _under(path: str, directory: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(directory))


def container_env(objects: tuple[Obj, ...], image_env: dict[str, str]) -> dict[str, str]:
    """The node's NODE_* environment in the first pod of ``objects``' StatefulSet, as the
    kubelet makes it: the image's, then the ConfigMap's, then the container's ``env``."""
    statefulset = only(objects, "StatefulSet")
    cont = container(statefulset)
    env = {k: v for k, v in image_env.items() if k.startswith("NODE_")}
    for source in cont.get("envFrom", []):
        env.update(only(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    fields = {
        "metadata.name": f"{statefulset['metadata']['name']}-{POD_INDEX}",
        "metadata.labels['apps.kubernetes.io/pod-index']": POD_INDEX,
        "metadata.namespace": statefulset["metadata"].get("namespace", "default"),
    }
    for variable in cont.get("env", []):
        if "value" in variable:
            # $(NAME) is a variable defined before this one, as the kubelet expands it.
            env[variable["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), variable["value"]
            )
            continue
        reference = variable["valueFrom"]
        if "fieldRef" in reference:
            env[variable["name"]] = fields[reference["fieldRef"]["fieldPath"]]
        else:
            assert "secretKeyRef" in reference, reference
            env[variable["name"]] = ADMIN_TOKEN
    return env


@contextmanager
def pod_environment(
    objects: tuple[Obj, ...], image_env: dict[str, str], root: Path
) -> Iterator[dict[str, str]]:
    """``container_env`` with the pod's volumes under ``root`` and its raw block volumes as
    loop devices."""
    statefulset = only(objects, "StatefulSet")
    cont = container(statefulset)
    env = container_env(objects, image_env)
    mounts = [m["mountPath"] for m in cont.get("volumeMounts", [])]
    for mount in mounts:
        (root / mount.lstrip("/")).mkdir(parents=True, exist_ok=True)
    claims = {c["metadata"]["name"]: c for c in statefulset["spec"]["volumeClaimTemplates"]}
    with ExitStack() as stack:
        devices: dict[str, str] = {}
        for device in cont.get("volumeDevices", []):
            size = quantity_bytes(
                claims[device["name"]]["spec"]["resources"]["requests"]["storage"]
            )
            backing = root / f"{device['name']}.img"
            loop = stack.enter_context(sparse_loop_device(backing, size))
            devices[device["devicePath"]] = str(loop)
        for key in PATH_SETTINGS & set(env):
            value = env[key]
            if value in devices:
                env[key] = devices[value]
            else:
                # The root file system is read-only: a path the node writes must be a volume.
                assert any(_under(value, m) for m in mounts), f"{key}={value} is on no volume"
                env[key] = str(root / value.lstrip("/"))
        # What the zone init container writes before the node starts (tests/deploy/test_zone.py
        # runs it against an API server; the pod's network here reaches none).
        if "NODE_ZONE_FILE" in env:
            write_zone(Path(env["NODE_ZONE_FILE"]), POD_ZONE)
        # This machine's disk may be nearly full; the watermarks must not turn a probe test
        # read-only. Only settings the manifests leave at their defaults are moved.
        for key, value in as_env(HOST_DISK_NEUTRAL).items():
            env.setdefault(key, value)
        env["PATH"] = os.environ["PATH"]
        yield env
