"""`make image`: the storage node's image, built from the Dockerfile with podman (docker where
its daemon answers), tagged ``storage-node:<version of pyproject>``.

The base is the Dockerfile's default, the official ``python:3.11-slim-bookworm``, where a
registry gives it; where none is reachable, a Debian bookworm base is made here with
debootstrap (Debian's own Python 3.11) and passed as the ``PYTHON_IMAGE`` build argument. That
locally made base also carries this machine's CA bundle and a pip ``cert`` setting: downloads
here may go through a TLS-intercepting proxy, a fact of the machine, never of the Dockerfile.

A build is skipped when an image of the tag already carries the digest of its inputs (the
build context, the Dockerfile, the base image's id) in its ``storage-node.inputs`` label.
Only the standard library: ``make image`` needs no virtual environment.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path, PurePosixPath
from typing import IO

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
TAG = f"{PROJECT['name']}:{PROJECT['version']}"
INPUTS_LABEL = "storage-node.inputs"
# The Dockerfile's build stage, tagged: its layers (the locked dependencies) stay as the next
# build's cache, where the prune after a build would remove them untagged.
BUILD_STAGE = "build"
BUILD_STAGE_TAG = f"{PROJECT['name']}-build-stage:{PROJECT['version']}"
BASE_LABEL = "org.opencontainers.image.base.name"
# Made with debootstrap when the official base cannot be pulled; Debian 12's Python is 3.11.
LOCAL_BASE = "localhost/storage-node-base:python3.11-bookworm"
LOCAL_BASE_PACKAGES = "python3,python3-venv,python3-pip,python-is-python3"
LOCAL_BASE_SUITE = "bookworm"
# What the official image sets and an imported root file system lacks.
LOCAL_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PULL_TIMEOUT_S = 600.0  # a slow registry; bounds a hang only
DEBOOTSTRAP_TIMEOUT_S = 900.0  # ~40 s here
BUILD_TIMEOUT_S = 1200.0  # ~30 s here (pip downloads the locked wheels)
IMPORT_TIMEOUT_S = 300.0  # ~200 MB into the image store
QUERY_TIMEOUT_S = 60.0  # `podman image inspect` and the like


class ImageError(RuntimeError):
    """The image cannot be built here; the message says what is missing."""


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative: PurePosixPath, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves ``relative`` out, as Docker reads it: the last pattern that
    matches the path or one of its parents decides, ``!`` re-includes, ``**/`` is any depth."""
    excluded = False
    for raw in patterns:
        negated = raw.startswith("!")
        pattern = raw.lstrip("!")
        prefixes = ["/".join(relative.parts[: n + 1]) for n in range(len(relative.parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in relative.parts)
        else:
            hit = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if hit:
            excluded = not negated
    return excluded


def context_files() -> list[Path]:
    """The files a build sends to the builder (the repository less .dockerignore)."""
    patterns = dockerignore()
    negations = [p[1:] for p in patterns if p.startswith("!")]
    files = []
    for top, dirs, names in os.walk(REPO):
        here = PurePosixPath(Path(top).relative_to(REPO).as_posix())
        # An ignored directory is walked only if a `!` pattern may re-include inside it
        # (the virtual environments hold gigabytes).
        dirs[:] = sorted(
            d
            for d in dirs
            if not ignored(here / d, patterns)
            or any(n.startswith(("*", f"{here / d}/")) for n in negations)
        )
        files += [Path(top, n) for n in sorted(names) if not ignored(here / n, patterns)]
    return files


def _run(
    argv: list[str], timeout: float, stdin: IO[bytes] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdin=stdin, capture_output=True, text=True, timeout=timeout, check=False
    )


def engine() -> str:
    """The container engine: docker when its daemon answers, else podman."""
    docker = shutil.which("docker")
    if docker and _run([docker, "info"], QUERY_TIMEOUT_S).returncode == 0:
        return docker
    podman = shutil.which("podman")
    if podman is None:
        raise ImageError("no container engine: install podman with `make tools` (as root)")
    return podman


def _is_podman(tool: str) -> bool:
    """Podman, under its name or as podman-docker's `docker`."""
    return "podman" in _run([tool, "--version"], QUERY_TIMEOUT_S).stdout.lower()


def image_id(tool: str, name: str) -> str | None:
    done = _run([tool, "image", "inspect", "--format", "{{.Id}}", name], QUERY_TIMEOUT_S)
    return done.stdout.strip() if done.returncode == 0 else None


def label(tool: str, name: str, key: str) -> str | None:
    done = _run(
        [tool, "image", "inspect", "--format", f'{{{{index .Config.Labels "{key}"}}}}', name],
        QUERY_TIMEOUT_S,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def official_base() -> str:
    """The Dockerfile's default PYTHON_IMAGE, as a registry names it."""
    match = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    if match is None:
        raise ImageError("the Dockerfile has no `ARG PYTHON_IMAGE=` default")
    return f"docker.io/library/{match[1]}"


def _unmount_under(root: Path) -> None:
    """Detach every mount inside ``root``, deepest first, so that removing it removes only
    what debootstrap wrote."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if Path(m).is_relative_to(root)), reverse=True):
        _run(["umount", "--lazy", mount], QUERY_TIMEOUT_S)


def make_local_base(tool: str) -> None:
    """A Debian base with debootstrap, imported as LOCAL_BASE."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise ImageError("no registry gives the base and debootstrap is missing: `make tools`")
    with tempfile.TemporaryDirectory(prefix="storage-node-base-") as scratch:
        root = Path(scratch) / "root"
        made = _run(
            [
                debootstrap,
                "--variant=minbase",
                f"--include={LOCAL_BASE_PACKAGES}",
                LOCAL_BASE_SUITE,
                str(root),
            ],
            DEBOOTSTRAP_TIMEOUT_S,
        )
        if made.returncode != 0:
            _unmount_under(root)  # a debootstrap that failed may leave /proc mounted there
            raise ImageError(f"debootstrap failed (root is needed):\n{made.stdout[-3000:]}")
        # The apt lists and the downloaded .debs are not part of a base.
        for cache in (root / "var/cache/apt/archives", root / "var/lib/apt/lists"):
            for item in cache.glob("*"):
                if item.is_file():
                    item.unlink()
        if HOST_CA_BUNDLE.exists():
            # This machine's trust (its proxy's CA included), for pip inside the build.
            shutil.copyfile(HOST_CA_BUNDLE, root / HOST_CA_BUNDLE.relative_to("/"))
            (root / "etc/pip.conf").write_text(f"[global]\ncert = {HOST_CA_BUNDLE}\n")
        changes = [a for k, v in LOCAL_BASE_ENV.items() for a in ("--change", f"ENV {k}={v}")]
        with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as tar:
            imported = _run(
                [tool, "import", *changes, "-", LOCAL_BASE], IMPORT_TIMEOUT_S, tar.stdout
            )
        if imported.returncode != 0 or tar.returncode != 0:
            raise ImageError(f"{tool} import failed: {imported.stderr.strip()}")


def base(tool: str) -> str:
    """The official base when present or pullable, else the local one (made once)."""
    official = official_base()
    if image_id(tool, official):
        return official
    pulled = _run([tool, "pull", official], PULL_TIMEOUT_S)
    if pulled.returncode == 0:
        return official
    print(f"{official} cannot be pulled ({pulled.stderr.strip()[-200:]}); a local base instead")
    if not image_id(tool, LOCAL_BASE):
        started = time.monotonic()
        make_local_base(tool)
        print(f"made {LOCAL_BASE} in {time.monotonic() - started:.0f} s")
    return LOCAL_BASE


def inputs_digest(base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    for path in [DOCKERFILE, REPO / ".dockerignore", *context_files()]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def build(tool: str | None = None) -> str:
    """Build TAG unless an image of its inputs exists; the tag, as the engine names it."""
    tool = tool or engine()
    base_name = base(tool)
    base_id = image_id(tool, base_name)
    assert base_id, base_name
    digest = inputs_digest(base_id)
    if label(tool, TAG, INPUTS_LABEL) == digest:
        print(f"{TAG} is up to date (inputs {digest[:12]})")
        return TAG
    options = ["--network", "host", "--file", str(DOCKERFILE)]
    if _is_podman(tool):
        # The OCI format has no HEALTHCHECK; Debian's default crun refuses hybrid cgroups.
        options += ["--format", "docker"]
        if shutil.which("runc"):
            options += ["--runtime", "runc"]
    options += ["--build-arg", f"PYTHON_IMAGE={base_name}"]
    labels = ["--label", f"{INPUTS_LABEL}={digest}", "--label", f"{BASE_LABEL}={base_name}"]
    old_stage = image_id(tool, BUILD_STAGE_TAG)
    started = time.monotonic()
    for argv in (
        [tool, "build", *options, "--target", BUILD_STAGE, "--tag", BUILD_STAGE_TAG],
        [tool, "build", *options, *labels, "--tag", TAG],  # the build stage from the cache
    ):
        done = _run([*argv, str(REPO)], BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise ImageError(
                f"{' '.join(argv)} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
    print(f"built {TAG} on {base_name} in {time.monotonic() - started:.0f} s")
    # The image this one replaced and the build stage before this one's, untagged now (its
    # layers that this one's reuses stay).
    _run([tool, "image", "prune", "--force", "--filter", f"label={INPUTS_LABEL}"], QUERY_TIMEOUT_S)
    if old_stage is not None and old_stage != image_id(tool, BUILD_STAGE_TAG):
        _run([tool, "image", "rm", old_stage], QUERY_TIMEOUT_S)
    return TAG


def main() -> int:
    try:
        build()
    except ImageError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
