"""The Dockerfile parsed as Docker parses it (dockerfile-parse), its promises checked against
the node and the manifests, and the lock against pyproject. The image it builds is run in
tests/deploy/test_image.py."""

from __future__ import annotations

import json
import re
import shlex
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

from dockerfile_parse import DockerfileParser
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from node.settings import Settings
from tests.deploy.lockfile import LOCK, read_lock, render, runtime_requirements
from tests.deploy.render import MANIFESTS, container, only
from tests.deploy.render import render as kustomize
from tools.image import dockerignore, ignored

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SETTING_VARIABLES = {f"NODE_{name.upper()}" for name in Settings.model_fields}
LIVENESS_PATH = "/heartbeat"
NOT_IN_CONTEXT = (".git", ".venv", "data", "node/__pycache__")


def _stages() -> list[list[dict[str, Any]]]:
    """The instructions of each stage, in order (what precedes the first FROM aside)."""
    stages: list[list[dict[str, Any]]] = []
    for instruction in DockerfileParser(str(DOCKERFILE)).structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages and instruction["instruction"] != "COMMENT":
            stages[-1].append(instruction)
    return stages


def _values(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [str(i["value"]) for i in stage if i["instruction"] == name]


def _env(stage: list[dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in _values(stage, "ENV"):
        for word in shlex.split(value):
            key, _, val = word.partition("=")
            env[key] = val
    return env


def _user(runtime: list[dict[str, Any]]) -> tuple[int, int]:
    uid, _, gid = _values(runtime, "USER")[-1].partition(":")
    return int(uid), int(gid)


def test_dockerfile_promises_match_the_node_and_the_manifests() -> None:
    stages = _stages()
    assert len(stages) >= 2, "multi-stage: a build stage and a slim runtime"
    runtime = stages[-1]
    parser = DockerfileParser(str(DOCKERFILE))
    # The runtime's Python is the one pyproject requires and the tests run on.
    tag = re.search(r"python:(\d+\.\d+)", parser.baseimage)
    assert tag, parser.baseimage
    assert SpecifierSet(PROJECT["requires-python"]).contains(tag[1] + ".0")
    assert tag[1] == f"{sys.version_info.major}.{sys.version_info.minor}"

    statefulset = only(kustomize("base"), "StatefulSet")
    cont = container(statefulset)
    pod_security = statefulset["spec"]["template"]["spec"]["securityContext"]
    uid, gid = _user(runtime)
    assert uid > 0 and gid > 0, "the image runs as root"
    assert (uid, gid) == (pod_security["runAsUser"], pod_security["runAsGroup"])

    entrypoint = json.loads(_values(runtime, "ENTRYPOINT")[-1])
    command = json.loads(_values(runtime, "CMD")[-1])
    assert [*entrypoint, *command] == ["python", "-m", "node", "serve"]
    assert cont["args"] == command, "the StatefulSet runs what the image runs"

    env = _env(runtime)
    node_env = {k for k in env if k.startswith("NODE_")}
    assert node_env <= SETTING_VARIABLES, sorted(node_env - SETTING_VARIABLES)
    assert "--config" not in command, "settings come from the environment only"
    assert env["NODE_HTTP_HOST"] == "0.0.0.0", "a container's loopback is its own"
    exposed = [int(p.split("/")[0]) for p in _values(runtime, "EXPOSE")]
    assert exposed == [int(env["NODE_HTTP_PORT"])]
    assert exposed == [p["containerPort"] for p in cont["ports"]]

    healthcheck = _values(runtime, "HEALTHCHECK")[-1]
    assert LIVENESS_PATH in healthcheck
    assert _values(runtime, "STOPSIGNAL") == ["SIGTERM"]

    labels = parser.labels
    assert labels["org.opencontainers.image.title"] == PROJECT["name"]
    assert labels["org.opencontainers.image.version"] == PROJECT["version"]
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]
    kustomization = (MANIFESTS / "base" / "kustomization.yaml").read_text()
    assert f"newTag: {PROJECT['version']}" in kustomization, "the manifests run this version"

    patterns = dockerignore()
    for path in NOT_IN_CONTEXT:
        assert ignored(PurePosixPath(path), patterns), f"{path} would be sent to the builder"


def test_lock_pins_every_runtime_dependency_within_pyproject() -> None:
    pins = read_lock(LOCK.read_text())
    for requirement in runtime_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in requirements.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    # The lock is what its generator makes from this environment: no hand edits, no drift.
    assert read_lock(render()) == pins, "regenerate: python -m tests.deploy.lockfile"
