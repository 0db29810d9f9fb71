"""The built image run with podman as the kubelet would run the StatefulSet's container: the
options below come from the rendered pod template, and what the container process got is
read back from the host's /proc (its uid, groups, capabilities, mounts and open files)."""

from __future__ import annotations

import base64
import copy
import json
import os
import resource
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.pod import POD_INDEX
from tests.deploy.render import Obj, container, of_kind, only, quantity_bytes

PODMAN_TIMEOUT_S = 120.0  # one podman command (a run, a stop within the grace period aside)
READY_TIMEOUT_S = 60.0  # a start on new volumes takes seconds; bounds a hang
REQUEST_TIMEOUT_S = 10.0
POLL_S = 0.1
UNLIMITED_FALLBACK = 1 << 20  # what an unlimited hard limit is given as
NPROC = 4096  # processes (threads) of the container's uid
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller


def podman_path() -> str:
    found = shutil.which("podman")
    if found is None:
        pytest.fail("podman is missing: `make tools` installs podman, buildah and runc (as root)")
    return found


def podman(*args: str, timeout: float = PODMAN_TIMEOUT_S, check: bool = True) -> str:
    done = subprocess.run(
        [podman_path(), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        pytest.fail(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout


def _limit(which: int) -> int:
    hard = resource.getrlimit(which)[1]
    return UNLIMITED_FALLBACK if hard == resource.RLIM_INFINITY else hard


def ulimits() -> dict[str, int]:
    """Limits within the host's: podman's defaults exceed them here (the run then fails). The
    node raises its soft open-files limit to the hard one, so it gets all the host allows."""
    return {
        "nofile": _limit(resource.RLIMIT_NOFILE),
        # Podman runs with a process limit of its own (32768 here, whatever the host's) and
        # cannot give a container more; the node needs a few dozen threads.
        "nproc": min(_limit(resource.RLIMIT_NPROC), NPROC),
    }


def run_options() -> list[str]:
    """What every container here needs: runc (Debian's crun refuses this machine's hybrid
    cgroups) and ``ulimits``."""
    return ["--runtime=runc", *[f"--ulimit={k}={n}:{n}" for k, n in ulimits().items()]]


def security_options(pod_spec: Obj, cont: Obj) -> list[str]:
    """The pod's and the container's securityContext, and the memory limit, as podman
    options."""
    pod_ctx, ctx = pod_spec["securityContext"], cont["securityContext"]
    options = ["--user", f"{pod_ctx['runAsUser']}:{pod_ctx['runAsGroup']}"]
    options += [f"--group-add={gid}" for gid in pod_ctx.get("supplementalGroups", [])]
    options += [f"--cap-drop={cap}" for cap in ctx["capabilities"]["drop"]]
    if ctx.get("allowPrivilegeEscalation") is False:
        options.append("--security-opt=no-new-privileges")
    if "memory" in cont["resources"].get("limits", {}):
        options.append(f"--memory={quantity_bytes(cont['resources']['limits']['memory'])}")
    if ctx.get("readOnlyRootFilesystem"):
        # Podman would add tmpfs at /tmp, /run and /var/tmp: only the manifests' volumes count.
        options += ["--read-only", "--read-only-tmpfs=false"]
    return options


@dataclass
class Volumes:
    """Host stand-ins for the pod's volumes: a directory per file-system claim (owned by
    fsGroup, as the kubelet makes it), tmpfs per emptyDir unless a directory stands for it
    (one an init container fills), a loop device per raw claim."""

    directories: dict[str, Path]  # mount path -> host directory
    devices: dict[str, Path]  # device path in the container -> loop device

    def options(self, statefulset: Obj) -> list[str]:
        spec = statefulset["spec"]["template"]["spec"]
        cont = container(statefulset)
        options: list[str] = []
        empty_dirs = {v["name"]: v["emptyDir"] for v in spec["volumes"] if "emptyDir" in v}
        for mount in cont["volumeMounts"]:
            path = mount["mountPath"]
            if mount["name"] in empty_dirs and path not in self.directories:
                size = quantity_bytes(empty_dirs[mount["name"]]["sizeLimit"])
                options.append(f"--tmpfs={path}:rw,size={size}")
            else:
                access = "ro" if mount.get("readOnly") else "rw"
                options.append(f"--volume={self.directories[path]}:{path}:{access}")
        options += [f"--device={loop}:{path}" for path, loop in self.devices.items()]
        return options


@dataclass
class Running:
    name: str
    port: int  # on the host's loopback
    pid: int  # of the node, as the host sees it

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def request(
        self, method: str, path: str, body: bytes | None = None, token: str | None = None
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/octet-stream"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url(path), data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def proc_status(self) -> dict[str, str]:
        """The node's /proc/PID/status as the host sees it."""
        lines = Path(f"/proc/{self.pid}/status").read_text().splitlines()
        return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}

    def environ(self) -> dict[str, str]:
        raw = Path(f"/proc/{self.pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode().partition("=")[::2] for item in raw if item)

    def mount_options(self, mount_point: str) -> set[str]:
        """The options of the mount at ``mount_point`` in the container (the last one)."""
        found: set[str] = set()
        for line in Path(f"/proc/{self.pid}/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[4] == mount_point:
                found = set(fields[5].split(","))
        return found

    def open_flags(self, target: str) -> list[int]:
        """The flags of every descriptor the node holds open on ``target``."""
        flags = []
        fds = Path(f"/proc/{self.pid}/fd")
        for fd in fds.iterdir():
            try:
                if os.readlink(fd) != target:
                    continue
                info = Path(f"/proc/{self.pid}/fdinfo/{fd.name}").read_text()
            except FileNotFoundError:
                continue  # closed meanwhile
            for line in info.splitlines():
                if line.startswith("flags:"):
                    flags.append(int(line.split()[1], 8))
        return flags

    def logs(self) -> str:
        """Its output (the node logs to stderr, which podman logs gives on stderr)."""
        done = subprocess.run(
            [podman_path(), "logs", self.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=PODMAN_TIMEOUT_S,
            check=False,
        )
        return done.stdout[-6000:]

    def inspect(self) -> dict[str, Any]:
        inspected: list[dict[str, Any]] = json.loads(podman("inspect", self.name))
        return inspected[0]


def started(name: str, port: int, ready_path: str) -> Running:
    """The container ``name``, serving on ``port``, once ``ready_path`` answers 200."""
    pid = int(podman("inspect", "--format", "{{.State.Pid}}", name).strip())
    running = Running(name, port, pid)
    wait_ready(running, ready_path)
    return running


def wait_ready(running: Running, path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            status, _ = running.request("GET", path)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            status = 0
        if status == 200:
            return
        state = running.inspect()["State"]
        if not state["Running"]:
            pytest.fail(f"container exited {state['ExitCode']}:\n{running.logs()}")
        time.sleep(POLL_S)
    pytest.fail(f"{path} never answered 200:\n{running.logs()}")


@contextmanager
def run_container(
    image: str, options: list[str], command: list[str], port: int, ready_path: str
) -> Iterator[Running]:
    """``image`` started detached with ``options`` and ``command``, its ``port`` published on
    a free loopback port, once ``ready_path`` answers 200; removed on exit whatever its
    state."""
    name = f"storage-node-test-{uuid.uuid4().hex[:12]}"
    podman(
        "run",
        "--detach",
        f"--name={name}",
        f"--publish=127.0.0.1::{port}",
        *run_options(),
        *options,
        image,
        *command,
    )
    try:
        published = podman("port", name, f"{port}/tcp").strip().rpartition(":")[2]
        yield started(name, int(published), ready_path)
    finally:
        podman("rm", "--force", "--time=0", name, check=False)


def statefulset_parts(objects: tuple[Obj, ...]) -> tuple[Obj, Obj, Obj]:
    statefulset = only(objects, "StatefulSet")
    return statefulset, statefulset["spec"]["template"]["spec"], container(statefulset)


def playable_pod(
    objects: tuple[Obj, ...], image: str, env: dict[str, str], port: int, zone_dir: Path
) -> list[Obj]:
    """The first pod of ``objects``' StatefulSet with its ConfigMap and claims, as podman
    4.3's `kube play` can play them. What it cannot, changed here (docs/deploying.md):

    - a StatefulSet: its first pod instead, named and labelled as the controller names it,
      with a claim per volume claim template (``<claim>-<pod>``);
    - ``fieldRef: metadata.namespace`` is refused and ``$(VAR)`` is left unexpanded: those
      variables get the values the kubelet gives (``env``);
    - a container port without ``hostPort`` is published on every host interface: here on
      ``port`` of the host's loopback;
    - an ``httpGet`` probe becomes a ``curl`` check on port 0 (a named port is not resolved,
      and the image has no curl): the probes go, and the test calls their paths. Without
      them the image's HEALTHCHECK is dropped too: a played pod has no health check;
    - the zone init container asks the Kubernetes API for its node's label, and its token is a
      projected volume: both go, and its emptyDir becomes ``zone_dir``, where the test wrote
      what it would have (tests/deploy/test_zone.py runs the init container's command).
    """
    statefulset = only(objects, "StatefulSet")
    template = copy.deepcopy(statefulset["spec"]["template"])
    pod_name = f"{statefulset['metadata']['name']}-{POD_INDEX}"
    spec = template["spec"]
    cont = spec["containers"][0]
    cont["image"] = image if "/" in image.split(":")[0] else f"localhost/{image}"
    for variable in cont["env"]:
        if "fieldRef" in variable.get("valueFrom", {}) or "$(" in variable.get("value", ""):
            variable.pop("valueFrom", None)
            variable["value"] = env[variable["name"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cont.pop(probe)
    for container_port in cont["ports"]:
        container_port.update(hostPort=port, hostIP="127.0.0.1")
    spec.pop("initContainers", None)
    spec["volumes"] = [v for v in spec["volumes"] if "projected" not in v]
    for volume in spec["volumes"]:
        if volume["name"] == "zone":
            volume.pop("emptyDir")
            volume["hostPath"] = {"path": str(zone_dir), "type": "Directory"}
    claims = []
    for claim in statefulset["spec"]["volumeClaimTemplates"]:
        name = f"{claim['metadata']['name']}-{pod_name}"
        claims.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": name},
                "spec": claim["spec"],
            }
        )
        spec["volumes"].append(
            {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": name}}
        )
    labels = {**template["metadata"]["labels"], POD_INDEX_LABEL: POD_INDEX}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name, "labels": labels},
        "spec": spec,
    }
    return [*of_kind(objects, "ConfigMap"), *claims, pod]


def secrets_of(cont: Obj, token: str) -> dict[str, dict[str, str]]:
    """The Secrets the container's ``env`` names, each key holding ``token``."""
    found: dict[str, dict[str, str]] = {}
    for variable in cont.get("env", []):
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            found.setdefault(ref["name"], {})[ref["key"]] = token
    return found


@contextmanager
def kube_play(docs: list[Obj], secrets: dict[str, dict[str, str]], scratch: Path) -> Iterator[str]:
    """``docs`` played with `podman kube play`; the pod's name. Podman 4.3 misreads a Secret
    document (stored as YAML, read as JSON): each secret is made with `podman secret create`
    in the form it reads, a JSON map of base64 values. Kube play takes no runtime or ulimit
    options: they go in a containers.conf of its own."""
    pod = docs[-1]["metadata"]["name"]
    claims = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
    conf = scratch / "containers.conf"
    limits = ", ".join(f'"{k}={n}:{n}"' for k, n in ulimits().items())
    conf.write_text(f'[containers]\ndefault_ulimits = [{limits}]\n[engine]\nruntime = "runc"\n')
    play = scratch / "pod.yaml"
    play.write_text(yaml.safe_dump_all(docs))

    def remove() -> None:
        podman("pod", "rm", "--force", "--time=0", pod, check=False)
        podman("volume", "rm", "--force", *claims, check=False)
        for name in secrets:
            podman("secret", "rm", name, check=False)

    remove()  # what a run killed before its clean-up left
    try:
        for name, data in secrets.items():
            file = scratch / f"{name}.json"
            encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
            file.write_text(json.dumps(encoded))
            podman("secret", "create", name, str(file))
        done = subprocess.run(
            [podman_path(), "kube", "play", str(play)],
            env={**os.environ, "CONTAINERS_CONF": str(conf)},
            capture_output=True,
            text=True,
            timeout=PODMAN_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"podman kube play: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        yield pod
    finally:
        remove()
