"""The built image, run with podman as the StatefulSet runs it (tests/deploy/container.py).
The image is built once per session, or reused when its inputs are unchanged
(tools/image.py, the same code as `make image`)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.kubezone import write_zone
from tests.deploy.container import (
    PODMAN_TIMEOUT_S,
    Running,
    Volumes,
    kube_play,
    playable_pod,
    podman,
    podman_path,
    run_container,
    run_options,
    secrets_of,
    security_options,
    started,
    statefulset_parts,
)
from tests.deploy.lockfile import LOCK, dev_only_names, read_lock
from tests.deploy.pod import (
    ADMIN_TOKEN,
    NO_METADATA_STORE,
    POD_ZONE,
    container_env,
    sparse_loop_device,
)
from tests.deploy.render import Obj, of_kind, quantity_bytes, render
from tests.harness.hostdisk import HOST_DISK_NEUTRAL, as_env
from tests.harness.ports import free_port
from tools import image as image_build

# The image as built here: pyarrow alone is ~170 MB; the local Debian base ~200 MB.
IMAGE_SIZE_LIMIT = 600 * 10**6
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "make", "ld")
DISK_GID = 6  # the group of block devices on the hosts docs/deploying.md names
SETTINGS_PATH = "/api/v1/config/server_config"
LEDGER = 1
ENTRIES = 300
MAX_ENTRY = 64 * 1024
SIGKILL_EXIT = 128 + 9
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
STATUS_JS = "/status/status.js"


@pytest.fixture(scope="module")
def image() -> str:
    tool = podman_path()  # fails with the way to get it
    try:
        return image_build.build(tool)
    except image_build.ImageError as e:
        pytest.fail(str(e))


def test_image_holds_the_locked_packages_and_no_compiler(image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).strip())
    assert size < IMAGE_SIZE_LIMIT, f"{image} is {size / 1e6:.0f} MB"
    config = podman(
        "image", "inspect", "--format", "{{.Config.User}} {{.Config.Healthcheck.Test}}", image
    )
    assert config.startswith("10001:10001 "), config
    assert "/heartbeat" in config, "HEALTHCHECK lost (podman keeps it with --format docker)"
    # What is installed in the runtime, read inside it: the venv's packages and any compiler.
    script = (
        "import shutil, subprocess, sys; "
        "print(subprocess.run([sys.executable, '-m', 'pip', 'freeze', '--exclude', "
        f"'{image_build.PROJECT['name']}'], capture_output=True, text=True, check=True).stdout); "
        f"print('compilers:', [c for c in {COMPILERS!r} if shutil.which(c)])"
    )
    seen = podman(
        "run",
        "--rm",
        "--no-healthcheck",
        *run_options(),
        "--entrypoint=python",
        image,
        "-c",
        script,
    )
    frozen, _, compilers = seen.partition("compilers:")
    assert compilers.strip() == "[]", compilers
    assert read_lock(frozen) == read_lock(LOCK.read_text()), "the image is not the lock"
    assert not dev_only_names() & set(read_lock(frozen)), "dev extras in the image"


@pytest.fixture
def raw_wal(tmp_path: Path) -> Iterator[Path]:
    """A loop device of the WAL claim's size, ``root:disk`` ``0660`` as on the hosts the
    docs/deploying.md names (loop devices are made ``0600`` here)."""
    statefulset, _, _ = statefulset_parts(render("base"))
    claims = {c["metadata"]["name"]: c for c in statefulset["spec"]["volumeClaimTemplates"]}
    size = quantity_bytes(claims["wal"]["spec"]["resources"]["requests"]["storage"])
    with sparse_loop_device(tmp_path / "wal.img", size) as device:
        os.chown(device, 0, DISK_GID)
        device.chmod(0o660)
        yield device


def _add_entries(node: Running, rng: random.Random) -> dict[int, bytes]:
    """Entries of random sizes added one by one; the acknowledged ones by id."""
    acked: dict[int, bytes] = {}
    for _ in range(ENTRIES):
        payload = rng.randbytes(rng.randint(0, MAX_ENTRY))
        path = f"/api/v1/ledgers/{LEDGER}/entries"
        status, body = node.request("POST", path, payload, ADMIN_TOKEN)
        assert status == 201, body
        acked[json.loads(body)["entryId"]] = payload
    return acked


def _check_as_the_pod_says(node: Running, pod_spec: Obj, cont: Obj, env: dict[str, str]) -> None:
    """What the node process got, read from the host's /proc, against the pod spec; then its
    probes and status page, its settings, and writes with and without the token."""
    status = node.proc_status()
    security = pod_spec["securityContext"]
    uid, gid = security["runAsUser"], security["runAsGroup"]
    assert status["Uid"].split() == [str(uid)] * 4, status["Uid"]
    assert status["Gid"].split() == [str(gid)] * 4, status["Gid"]
    groups = {int(g) for g in status["Groups"].split()}
    assert set(security["supplementalGroups"]) <= groups, status["Groups"]
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert status["NoNewPrivs"] == "1", "privilege escalation allowed"
    assert status["Seccomp"] == "2", "no seccomp filter (RuntimeDefault)"
    assert "ro" in node.mount_options("/"), "the root file system is writable"
    for mount in cont["volumeMounts"]:
        expected = "ro" if mount.get("readOnly") else "rw"
        assert expected in node.mount_options(mount["mountPath"]), mount
    memory = quantity_bytes(cont["resources"]["limits"]["memory"])
    assert node.inspect()["HostConfig"]["Memory"] == memory
    environ = node.environ()
    assert {k: environ.get(k) for k in env} == env

    for probe in PROBES:
        answer = node.request("GET", cont[probe]["httpGet"]["path"])
        assert answer[0] == 200, (probe, answer)
    page, script = node.request("GET", "/status"), node.request("GET", STATUS_JS)
    # The page and its script are the wheel's package data.
    assert page[0] == 200 and STATUS_JS.encode() in page[1], page[0]
    assert script[0] == 200 and b"use strict" in script[1], script[0]
    code, body = node.request("GET", SETTINGS_PATH, token=ADMIN_TOKEN)
    assert code == 200, body
    config = json.loads(body)
    assert config["wal_kind"] == env["NODE_WAL_KIND"]
    assert config["node_id"] == int(env["NODE_NODE_ID"])
    assert config["data_dir"] == env["NODE_DATA_DIR"]
    assert config["admin_token"] == "******"

    assert node.request("PUT", f"/api/v1/ledgers/{LEDGER}", b"")[0] == 401
    assert node.request("PUT", f"/api/v1/ledgers/{LEDGER}", b"", ADMIN_TOKEN)[0] == 201


def _stop_within_the_grace_period(node: Running, pod_spec: Obj, stop: list[str]) -> None:
    grace = pod_spec["terminationGracePeriodSeconds"]
    started = time.monotonic()
    podman(*stop, f"--time={grace}", timeout=grace + PODMAN_TIMEOUT_S)
    stop_s = time.monotonic() - started
    assert node.inspect()["State"]["ExitCode"] == 0, node.logs()
    assert stop_s < grace, "the kubelet would SIGKILL before the final checkpoint"
    assert "stopped cleanly" in node.logs()


def _zone_written(tmp_path: Path, cont: Obj) -> tuple[str, Path]:
    """The zone volume's mount path, and a host directory holding what the zone init container
    would write there (it needs an API server: tests/deploy/test_zone.py runs it)."""
    mount = next(m["mountPath"] for m in cont["volumeMounts"] if m["name"] == "zone")
    directory = tmp_path / "zone"
    directory.mkdir()
    write_zone(directory / "zone", POD_ZONE)
    directory.chmod(0o755)
    return mount, directory


def test_container_runs_as_the_statefulset_and_keeps_what_it_acknowledged(
    image: str, raw_wal: Path, tmp_path: Path
) -> None:
    objects = render("base")
    statefulset, pod_spec, cont = statefulset_parts(objects)
    env = container_env(objects, {})
    for key, value in as_env(HOST_DISK_NEUTRAL).items():
        env.setdefault(key, value)
    env.update(NO_METADATA_STORE)
    data = tmp_path / "data"
    data.mkdir()
    # fsGroup: the kubelet gives a file-system volume to the pod's group, group-writable.
    uid, gid = pod_spec["securityContext"]["runAsUser"], pod_spec["securityContext"]["runAsGroup"]
    os.chown(data, 0, pod_spec["securityContext"]["fsGroup"])
    data.chmod(0o2775)
    wal_path = cont["volumeDevices"][0]["devicePath"]
    assert env["NODE_WAL_PATH"] == wal_path
    zone_dir = _zone_written(tmp_path, cont)
    volumes = Volumes({"/data": data, zone_dir[0]: zone_dir[1]}, {wal_path: raw_wal})
    options = [
        *security_options(pod_spec, cont),
        *volumes.options(statefulset),
        *[f"--env={k}={v}" for k, v in env.items()],
    ]
    ready = cont["startupProbe"]["httpGet"]["path"]
    port = cont["ports"][0]["containerPort"]
    rng = random.Random(30)

    with run_container(image, options, cont["args"], port, ready) as node:
        _check_as_the_pod_says(node, pod_spec, cont, env)
        healthcheck = subprocess.run(
            [podman_path(), "healthcheck", "run", node.name],
            capture_output=True,
            text=True,
            timeout=PODMAN_TIMEOUT_S,
            check=False,
        )
        assert healthcheck.returncode == 0, healthcheck
        # The raw-device WAL: the device node as the host has it (root:disk 0660), opened
        # for O_DIRECT writes by uid 10001 through the disk group.
        wal_flags = node.open_flags(wal_path)
        assert wal_flags, f"{wal_path} is not open"
        assert all(f & os.O_DIRECT and f & os.O_RDWR for f in wal_flags), list(map(oct, wal_flags))
        acked = _add_entries(node, rng)
        owners = {(p.stat().st_uid, p.stat().st_gid) for p in data.rglob("*")}
        assert owners == {(uid, gid)}, owners

        # The crash: SIGKILL, no final checkpoint.
        podman("kill", "--signal=KILL", node.name)
        podman("wait", node.name)
        assert node.inspect()["State"]["ExitCode"] == SIGKILL_EXIT

    # The kubelet restarts it on the same volumes: every acknowledged entry, byte for byte.
    with run_container(image, options, cont["args"], port, ready) as node:
        code, body = node.request("GET", f"/api/v1/ledgers/{LEDGER}")
        assert code == 200, body
        assert json.loads(body)["entries"] == len(acked), body
        # One read per entry: a range reply may stop part way (max_read_reply_bytes).
        for entry_id, payload in acked.items():
            path = f"/api/v1/ledgers/{LEDGER}/entries/{entry_id}"
            assert node.request("GET", path) == (200, payload), entry_id
        # Replayed from the raw device's ring: the first run's checkpoint period had not come.
        replayed = re.search(r"replayed (\d+) WAL records", node.logs())
        assert replayed and int(replayed[1]) > 0, node.logs()
        _add_entries(node, rng)  # a write cache for the final checkpoint to flush
        _stop_within_the_grace_period(node, pod_spec, ["stop", node.name])


def test_kube_play_of_the_local_overlay(image: str, tmp_path: Path) -> None:
    """The local overlay's pod, its ConfigMap and claims played by podman (what podman 4.3
    cannot play is listed in ``playable_pod`` and ``kube_play``)."""
    objects = render("overlays/local")
    _, pod_spec, cont = statefulset_parts(objects)
    env = container_env(objects, {})
    port = free_port()
    docs = playable_pod(objects, image, env, port, _zone_written(tmp_path, cont)[1])
    # Unset rather than empty: podman's kube play drops an `env` entry whose value is empty.
    for key in NO_METADATA_STORE:
        env.pop(key, None)
        for config_map in of_kind(docs, "ConfigMap"):
            config_map["data"].pop(key, None)
    pod = docs[-1]
    # Settings the manifests leave at their defaults only (tests/harness/hostdisk.py).
    extra = {k: v for k, v in as_env(HOST_DISK_NEUTRAL).items() if k not in env}
    pod["spec"]["containers"][0]["env"] += [{"name": k, "value": v} for k, v in extra.items()]
    ready = cont["startupProbe"]["httpGet"]["path"]
    with kube_play(docs, secrets_of(cont, ADMIN_TOKEN), tmp_path) as pod_name:
        node = started(f"{pod_name}-{cont['name']}", port, ready)
        node_env = {k: v for k, v in env.items() if k.startswith("NODE_")}
        _check_as_the_pod_says(node, pod_spec, cont, {**node_env, **extra})
        _add_entries(node, random.Random(28))
        # The file journal is on its own claim's volume, as the overlay puts it.
        claims = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
        journal = [c for c in claims if c.startswith("journal-")]
        volume = podman("volume", "inspect", "--format={{.Mountpoint}}", *journal)
        assert list(Path(volume.strip()).glob("*.txn")), "no journal on the journal claim"
        _stop_within_the_grace_period(node, pod_spec, ["pod", "stop", pod_name])
