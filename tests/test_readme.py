"""The walkthroughs of the README and of docs/, run as written against a node on a free port,
so that the docs cannot drift from the code: each ``sh`` block of the sections below runs under
``bash -euo pipefail`` (every curl in them fails on an HTTP error), in the order below,
against one fresh node, in a directory where ``data`` is that node's data directory (as
after ``make run``), in a shell whose PATH lacks the venv but for the README's activation
line, run first as a new shell would."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.hostdisk import REPO
from tests.harness.node import NodeProcess
from tests.harness.spark import quick_jvm_env

README = REPO / "README.md"
DOCS = REPO / "docs"
# (file under the repository, its "## " section): every walkthrough, wherever it lives.
WALKTHROUGHS = (
    ("README.md", "Five minutes with a node"),
    ("docs/api.md", "Ledgers"),
    ("docs/api.md", "Streams"),
    ("docs/operations.md", "Offload (tiered storage)"),
    ("docs/operations.md", "Audit (Spark)"),
    ("docs/api.md", "Admin API (BookKeeper's paths and shapes)"),
    ("docs/operations.md", "Command line"),
)
README_ADDRESS = "localhost:8080"
BLOCK_TIMEOUT_S = 180  # the audit's block starts local Spark
ACTIVATE = ". .venv/bin/activate"
FENCED_SH = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def activation_block() -> str:
    """The README's first sh block but make's: how a new shell gets the venv's python."""
    intro = README.read_text().split("\n## ")[0]
    blocks = [b for b in FENCED_SH.findall(intro) if "make run" not in b]
    assert blocks == [ACTIVATE + "\n"], blocks
    return str(blocks[0])


def shell_env() -> dict[str, str]:
    """A new shell's environment: no venv on PATH (the activation line must bring it)."""
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if p and p != venv_bin)
    return env


def walkthrough_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path, title in WALKTHROUGHS:
        found = FENCED_SH.findall(_sections((REPO / path).read_text())[title])
        assert found, f"{path} section {title!r} has no sh block"
        blocks += [(title, block) for block in found]
    return blocks


def test_every_block_that_talks_to_a_node_is_walked() -> None:
    """A walkthrough moved to another page or section must move in WALKTHROUGHS too."""
    walked = {block for _, block in walkthrough_blocks()}
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for title, body in _sections(path.read_text()).items():
            for block in FENCED_SH.findall(body):
                if README_ADDRESS in block and "curl" in block:
                    assert block in walked, f"{path.name}, {title!r}: a curl block not run"


def test_every_curl_of_the_walkthrough_fails_on_an_http_error() -> None:
    """A curl that answers 4xx silently (plain -s) would let the README rot unseen."""
    for title, block in walkthrough_blocks():
        for line in block.splitlines():
            if re.search(r"\bcurl\b", line) and not line.lstrip().startswith("#"):
                assert "--fail-with-body" in line, f"{title}: {line}"


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's walkthroughs use curl")
def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    # The blocks run in tmp_path, the repository's root as the README sees it: ./data is the
    # node's, .venv the venv; payload.bin and the like land here, not in the repository.
    node = NodeProcess(tmp_path / "data")
    node.start()
    (tmp_path / ".venv").symlink_to(sys.prefix)
    activate = activation_block()
    env = {**shell_env(), **quick_jvm_env()}  # the audit block's JVM: its speed is not checked
    outputs: dict[str, str] = {}
    try:
        for i, (title, block) in enumerate(walkthrough_blocks()):
            script = activate + block.replace(README_ADDRESS, f"127.0.0.1:{node.port}")
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT_S,
                check=False,
            )
            assert result.returncode == 0, (
                f"walkthrough section {title!r}, block {i}, exit {result.returncode}:\n"
                f"{script}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n"
                f"{result.stderr[-3000:]}\n--- node\n{node.log()}"
            )
            assert "Warning" not in result.stderr, result.stderr  # e.g. curl's missing file
            outputs[title] = outputs.get(title, "") + result.stdout
        assert node.alive()
    finally:
        assert node.terminate() == 0
    quick, ledgers, streams, offload, audit, admin, inspect = (
        outputs[title] for _, title in WALKTHROUGHS
    )
    # The README's five minutes: a ledger written, read and closed; a stream read by a cursor.
    assert "hello" in quick and '"state": "closed"' in quick, quick[-2000:]
    assert re.search(r"f\s+i\s+r\s+s\s+t\s+e\s+v", quick), quick[-2000:]  # od -c of the frames
    assert "state: writable" in quick, quick[-2000:]
    assert quick.count("X-Duplicate: true") == 1 and "HTTP/1.1 201" in quick, quick[-2000:]
    # The ledger block: entries at 0, 1 (payload.bin) and 2-3 (the batch), read back.
    assert '"entryId": 1' in ledgers and '"lastEntryId": 3' in ledgers
    assert "hello" in ledgers and '"state": "closed"' in ledgers
    # The streams block: the first position was taken from the reply and read from.
    first = re.search(r"first position: (\d+):0 \(ledger (\d+)\)", streams)
    assert first is not None and first[1] == first[2], streams[:2000]
    assert f"X-Next-Position: {first[1]}:3" in streams
    assert f'"markDeletePosition": "{first[1]}:-1"' in streams  # reset to the first entry
    # The admin block: read-only on, then off again.
    assert '{"readOnly": true}' in admin and '{"readOnly": false}' in admin
    assert "storage_node_journal_fsync_seconds" in admin
    # The offload block: the ledger offloaded to the local store, its entry 1 still read.
    assert '"state": "offloaded"' in offload and offload.rstrip().endswith("bc"), offload[-2000:]
    # The audit block: every check clean, the result stored by the node.
    assert '"status": "clean"' in audit, audit[-3000:]
    # The inspect block: the journal and the index, every CRC checked.
    assert inspect.count("\nOK") >= 2 and "opened read-only" in inspect, inspect[-3000:]


def test_what_the_walkthroughs_leave_behind_is_ignored_by_git() -> None:
    left = ["payload.bin", "frames.bin", "audit-out/summary.json"]
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", *left],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert sorted(checked.stdout.split()) == sorted(left), checked


def _start_make_cluster(cwd: Path) -> tuple[subprocess.Popen[str], str]:
    """``make cluster``'s program (``python -m node.devcluster``, NODES at the Makefile's
    default) in ``cwd``, up: the process and the export line it printed."""
    from node.devcluster import DEFAULT_NODES
    from tests.harness.cluster import cluster_env

    makefile = (REPO / "Makefile").read_text()
    assert f"\nNODES ?= {DEFAULT_NODES}\n" in makefile
    assert "\t@exec $(PY) -m node.devcluster --nodes $(NODES)\n" in makefile
    proc = subprocess.Popen(
        [sys.executable, "-m", "node.devcluster"],
        cwd=cwd,
        env={**os.environ, **cluster_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:  # until it is up (or has exited)
        printed.append(line)
        if line.startswith("Ctrl-C"):
            break
    exports = [line.strip() for line in printed if "export NODE_METADATA_URL=" in line]
    assert exports and proc.poll() is None, "".join(printed)
    return proc, exports[0]


def test_the_replication_walkthrough_runs_as_written(tmp_path: Path) -> None:
    """The README's Replication blocks in a directory laid out as the repository's root:
    ``make cluster`` (its program: running make itself would check the venv's stamp against
    this copy), then the walkthrough with the export line it printed pasted in, which kills
    n1 (``cluster/n1/node.lock``), appends with three nodes of four, and brings n1 back with
    ``make cluster-node`` as written."""
    (tmp_path / ".venv").symlink_to(sys.prefix)
    for name in ("Makefile", "pyproject.toml", "requirements.lock"):
        (tmp_path / name).symlink_to(REPO / name)
    start, block = FENCED_SH.findall(_sections(README.read_text())["Replication"])
    assert start == "make cluster\n"
    export = block.splitlines()[0]
    assert export.startswith("export NODE_METADATA_URL=") and "paste" in export, export
    proc, printed = _start_make_cluster(tmp_path)
    try:
        script = activation_block() + block.replace(export, printed)
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    finally:
        proc.send_signal(signal.SIGINT)
        said, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, f"{script}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert proc.returncode == 0, said
    out = result.stdout
    listings = [part for part in out.split("id  url") if "registered" in part]
    assert len(listings) == 2, out
    for listing in listings:  # at the start and once n1 is back: all four registered
        rows = re.findall(r"^(n\d+) .* (yes|no)$", listing, re.MULTILINE)
        assert rows == [(f"n{i}", "yes") for i in range(4)], out
    assert '"state": "CLOSED"' in out and '"lastEntryId": 2' in out, out
    # The stream: the append through n2 was answered by n0 (owner), read back through n1.
    assert "created: 201" in out and re.search(r'\{"position": "\d+:0"\}', out), out
    assert "s   e   r   v   e   d       b   y       n   0" in out, out
    # n1 dead: the ledger read from the other two, the stream appended to.
    assert "0\thello\n1\treplicated\n2\tworld\n" in out, out
    assert re.search(r'\{"position": "\d+:\d+"\}\n(?!.*position)', out, re.DOTALL), out
    # make cluster said so, and brought it back.
    assert "node n1 exited with -9" in said and "node n1 started" in said, said
    assert "node n1 started: http://127.0.0.1:" in out, out
