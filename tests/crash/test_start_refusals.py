"""A node that cannot start as asked (its data directory is another live node's, a file, under
/proc or not writable by its user; its port is taken) says so in one line and exits 2 before
writing anything; a
node killed outright never blocks its own restart; the audit refuses a live node's data
directory (item 6)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.harness.hostdisk import REPO, neutral_env, run_node
from tests.harness.node import NodeProcess
from tests.harness.ports import free_port

START_TIMEOUT_S = 60.0


def _run_node(*args: str) -> subprocess.CompletedProcess[str]:
    return run_node(*args, timeout_s=START_TIMEOUT_S)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _assert_one_line_refusal(done: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_second_node_on_a_live_data_dir_is_refused_untouched(tmp_path: Path) -> None:
    first = NodeProcess(tmp_path / "data")
    first.start()
    assert first.proc is not None
    before = _tree(first.data_dir)

    done = _run_node("serve", "--data-dir", str(first.data_dir), "--port", str(free_port()))

    line = _assert_one_line_refusal(done, str(first.data_dir), f"pid {first.proc.pid}")
    assert "--data-dir" in line and "stop" in line
    after = _tree(first.data_dir)
    assert not [name for name in after if "LOG.old" in name]
    # The running node's own files may grow meanwhile (a checkpoint); the refused one
    # created none and left the index as it was.
    assert set(after) == set(before)
    assert first.alive()
    assert first.get_json("/api/v1/ledgers") is not None


def test_port_in_use_is_refused_before_any_file_is_written(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        data_dir = tmp_path / "data"

        done = _run_node("serve", "--data-dir", str(data_dir), "--port", str(port))

    _assert_one_line_refusal(done, str(port), "NODE_HTTP_PORT")
    assert not data_dir.exists()


def test_a_data_dir_that_is_a_file_is_refused_in_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_text("not a directory\n")

    done = _run_node("serve", "--data-dir", str(data), "--port", str(free_port()))

    _assert_one_line_refusal(done, str(data), "is a file, not a directory", "--data-dir")
    assert data.read_text() == "not a directory\n"

    done = _run_node("serve", "--data-dir", str(data / "sub"), "--port", str(free_port()))

    _assert_one_line_refusal(done, str(data / "sub"), f"{data} is a file")


def test_a_data_dir_on_a_pseudo_file_system_is_refused_in_one_line() -> None:
    """/proc holds no blocks: sized as a disk, it used to be refused as "0.0 MiB, too small"."""
    done = _run_node("serve", "--data-dir", "/proc/nope", "--port", str(free_port()))

    line = _assert_one_line_refusal(done, "/proc/nope", "cannot be created", "usable file system")
    assert "too small" not in line


NOBODY = "nobody"  # a user other than the directory's owner (root)


def _run_node_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m node ARGS`` as the user nobody (and its group), as the image runs its node
    as uid 10001."""
    return subprocess.run(
        [
            *("setpriv", f"--reuid={NOBODY}", f"--regid={_id(NOBODY, '-g')}", "--clear-groups"),
            *(sys.executable, "-m", "node", *args),
        ],
        env={**neutral_env(), "PYTHONPATH": str(REPO)},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=False,
    )


def _id(user: str, which: str) -> int:
    return int(subprocess.run(["id", which, user], capture_output=True, text=True).stdout)


def _nobody_can_run_the_node() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    return _run_node_as_nobody("--help").returncode == 0


@pytest.mark.parametrize("mode", [0o755, 0o000], ids=["root-owned", "mode-000"])
def test_a_data_dir_the_nodes_user_cannot_write_is_refused_naming_the_chown(mode: int) -> None:
    """The image's /data left owned by root: the node (uid 10001 there, nobody here) used to
    die with a traceback ending in PermissionError on /data/node.lock."""
    assert _nobody_can_run_the_node(), (
        "this test runs the node as nobody: it needs root, setpriv, and a repository and "
        "Python the user nobody can read"
    )
    # Under /tmp, not pytest's tmp_path: nobody may not enter root's pytest-of-root.
    with tempfile.TemporaryDirectory(prefix="refusal-") as parent:
        os.chmod(parent, 0o755)
        data = Path(parent) / "data"
        data.mkdir()
        data.chmod(mode)
        try:
            _assert_refused_naming_the_chown(data, _id(NOBODY, "-u"))
        finally:
            data.chmod(0o755)  # for the clean-up


def _assert_refused_naming_the_chown(data: Path, uid: int) -> None:

    done = _run_node_as_nobody("serve", "--data-dir", str(data), "--port", str(free_port()))

    _assert_one_line_refusal(done, str(data), "not writable", f"chown -R {uid} {data}")
    assert not list(data.iterdir())

    # Below it, a directory to be created: the fix names it and its parent.
    done = _run_node_as_nobody("serve", "--data-dir", str(data / "x"), "--port", str(free_port()))

    _assert_one_line_refusal(done, str(data / "x"), f"chown -R {uid} {data / 'x'}")


def test_a_killed_node_never_blocks_its_restart(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data")
    for _ in range(3):
        node.start()
        node.kill()  # SIGKILL: no cleanup of any kind, the lock file stays
        assert (node.data_dir / "node.lock").exists()
    node.start()
    assert node.terminate() == 0


def _append(node: NodeProcess, stream: str, payload: bytes) -> None:
    request = urllib.request.Request(
        f"{node.url}/api/v1/streams/{stream}/entries",
        data=payload,
        method="POST",
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(request, timeout=10):
        pass


def test_audit_refuses_a_live_data_dir(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data")
    node.start()
    assert node.proc is not None
    urllib.request.urlopen(
        urllib.request.Request(f"{node.url}/api/v1/streams/s", method="PUT"), timeout=10
    ).close()
    for _ in range(10):
        _append(node, "s", b"x" * 1000)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (node.data_dir / "ledgers").is_dir():  # an audit would find data to read
        assert time.monotonic() < deadline
        time.sleep(0.1)
    out = tmp_path / "audit-out"

    done = _run_node("audit", "--data-dir", str(node.data_dir), "--out", str(out))

    line = _assert_one_line_refusal(done, f"pid {node.proc.pid}", "POST /api/v1/audit/snapshot")
    assert "running" in line
    assert not out.exists()
    node.terminate()
    assert os.path.exists(node.data_dir / "node.lock")
