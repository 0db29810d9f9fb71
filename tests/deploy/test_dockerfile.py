"""The Dockerfile, without a Docker engine: parsed as Docker parses it (dockerfile-parse), its
promises checked against the node and the manifests, and its build stage performed step by
step (COPY from the context less .dockerignore, then each RUN with /bin/sh -c and the stage's
ENV, its paths under a temporary root). The node is then started from the virtual
environment those steps made, as the runtime stage starts it, and the HEALTHCHECK is run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

from dockerfile_parse import DockerfileParser
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from node.settings import Settings
from tests.deploy.image import dockerignore, ignored
from tests.deploy.lockfile import LOCK, read_lock, render, runtime_requirements
from tests.deploy.podrun import PodSpec, Probe, run_pod
from tests.deploy.render import MANIFESTS, container, only
from tests.deploy.render import render as kustomize
from tests.hostdisk import HOST_DISK_NEUTRAL, as_env

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SETTING_VARIABLES = {f"NODE_{name.upper()}" for name in Settings.model_fields}
BUILD_TIMEOUT_S = 600.0  # pip wheel + install into a new venv; bounds a hang only
LIVENESS_PATH = "/heartbeat"
STATUS_JS = "/status/status.js"  # the status page loads it: package data, in the wheel
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


def _copy_context(sources: list[str], dest: Path, patterns: list[str]) -> None:
    for source in sources:
        path = REPO / source
        assert path.exists(), f"COPY {source}: not in the build context"
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            relative = PurePosixPath(file.relative_to(REPO).as_posix())
            if ignored(relative, patterns):
                continue
            inside = relative.name if path.is_file() else Path(relative).relative_to(source)
            target = dest / inside
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)


def _run_build_stage(stage: list[dict[str, Any]], root: Path) -> dict[str, str]:
    """Perform ``stage``'s WORKDIR, COPY and RUN steps with its absolute paths under
    ``root``; the stage's ENV (so mapped) is returned."""
    env = {k: str(root / v.lstrip("/")) if v.startswith("/") else v for k, v in _env(stage).items()}
    patterns = dockerignore()
    workdir = root
    # The image's `python` is this interpreter: the same version (checked below).
    bin_dir = root / "usr-local-bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    shell_env = {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(root)}
    for instruction in stage:
        kind, value = instruction["instruction"], str(instruction["value"])
        if kind == "WORKDIR":
            workdir = root / value.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif kind == "COPY":
            words = value.split()
            assert not words[0].startswith("--"), "the build stage copies from the context only"
            dest = workdir / words[-1]
            _copy_context(words[:-1], dest, patterns)
        elif kind == "RUN":
            done = subprocess.run(
                ["/bin/sh", "-c", value],
                cwd=workdir,
                env=shell_env,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            assert done.returncode == 0, f"RUN {value}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
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


def test_image_build_steps_install_a_node_that_serves(tmp_path: Path) -> None:
    stages = _stages()
    build, runtime = stages[0], stages[-1]
    build_env = _run_build_stage(build, tmp_path / "build")
    venv = Path(build_env["VENV"])
    # The runtime stage takes exactly that environment and runs its python first.
    copied = [v for v in _values(runtime, "COPY") if v.startswith("--from=")]
    assert copied == [f"--from=build {_env(build)['VENV']} {_env(build)['VENV']}"]
    runtime_env = _env(runtime)
    assert runtime_env["PATH"].startswith(f"{_env(build)['VENV']}/bin:")

    # Installed without the dev extras, every library at its locked version.
    frozen = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude", PROJECT["name"]],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=True,
    ).stdout
    assert read_lock(frozen) == read_lock(LOCK.read_text())
    dev_names = {
        canonicalize_name(re.split(r"[<>=\[;]", d)[0])
        for d in PROJECT["optional-dependencies"]["dev"]
    }
    runtime_names = set(read_lock(LOCK.read_text()))
    assert not (dev_names - runtime_names) & set(read_lock(frozen)), "dev extras in the image"

    data = tmp_path / "data"
    data.mkdir()
    env = {k: v for k, v in runtime_env.items() if k != "PATH"}
    env["NODE_DATA_DIR"] = str(data)
    env["PATH"] = f"{venv / 'bin'}:{os.environ['PATH']}"
    for key, value in as_env(HOST_DISK_NEUTRAL).items():
        env.setdefault(key, value)
    port = int(runtime_env["NODE_HTTP_PORT"])
    healthcheck = _values(runtime, "HEALTHCHECK")[-1]
    check = json.loads(healthcheck.split("CMD", 1)[1])
    argv = [
        *json.loads(_values(runtime, "ENTRYPOINT")[-1]),
        *json.loads(_values(runtime, "CMD")[-1]),
    ]
    report = run_pod(
        PodSpec(
            # `python` from the image's PATH: the new venv's, not this one's
            argv=[str(venv / "bin" / argv[0]), *argv[1:]],
            env=env,
            cwd=str(data),  # WORKDIR /data: the repository's node/ is not importable here
            log=str(tmp_path / "node.log"),
            ready=Probe(port, LIVENESS_PATH),
            # The status page and its script come from the wheel's package data.
            probes=[Probe(port, LIVENESS_PATH), Probe(port, "/status"), Probe(port, STATUS_JS)],
            checks=[[str(venv / "bin" / check[0]), *check[1:]]],
        )
    )
    assert report["ready"], report["log"]
    assert report["probes"][0]["status"] == 200
    assert report["probes"][0]["body"] == "OK\n"
    page, script = report["probes"][1], report["probes"][2]
    assert page["status"] == 200 and STATUS_JS in page["body"], page
    assert script["status"] == 200 and "use strict" in script["body"], script["status"]
    assert report["checks_ready"] == [0], "HEALTHCHECK fails on a serving node"
    assert report["exit_code"] == 0, report["log"]
    assert report["checks_after"] != [0], "HEALTHCHECK passes with the node stopped"
    # What served was the wheel's node in the new environment, not this repository's.
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import node; print(node.__file__)"],
        cwd=data,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(venv), where
