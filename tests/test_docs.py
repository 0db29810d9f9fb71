"""The docs hold together: every relative link of README.md and docs/*.md leads to a file (or
folder) of the repository and, when it names one, to a heading of that file; and no file of
the repository cites a document that is not in it, nor an issue of this project by its number
(the fact itself belongs in the comment). Upstream projects' issues (BookKeeper, Pulsar ...)
are public references and may be cited."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tests.harness.hostdisk import REPO

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto: ...

# What the code may not cite: documents kept outside the repository, this project's issues.
OUTSIDE = re.compile(r"\bSPEC(\.md|\s+(section|\d))|\bSTACK\.md|\.\./shared\b")
ISSUE = re.compile(r"\b[Ii]ssues?\s+#?\d+|(?<![\w/])#\d{1,4}\b(?![0-9a-fA-F])")
# An issue number right after an upstream project's name is a public reference.
UPSTREAM = re.compile(
    r"\b(BookKeeper|Pulsar|RocksDB|RocketMQ|AutoMQ|Kafka|Redpanda|aiohttp|CPython|pydantic|"
    r"moto|obstore|Spark|Airflow|kubernetes|podman)\s*$",
    re.IGNORECASE,
)
SCANNED = ("node", "dags", "tests", "manifests", "grafana", "tools", "docs")
SCANNED_FILES = ("README.md", "Makefile", "Dockerfile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".js", ".html", ".sh"}
SKIPPED = ("node_modules", "screenshots", "__pycache__")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = CODE_SPAN.sub(lambda m: m[0].strip("`"), heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def links(path: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return [target for target in LINK.findall(text) if not EXTERNAL.match(target)]


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists() or root.resolve() not in (resolved, *resolved.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


def test_every_relative_link_of_the_docs_resolves() -> None:
    broken = {path.name: broken_links(path) for path in DOC_FILES}
    assert not any(broken.values()), broken


def test_the_link_checker_sees_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## The `code` (here)\n")
    page.write_text(
        "# Page\n\n[ok](other.md#the-code-here) [self](#page) [gone](missing.md) "
        "[nohead](other.md#nowhere) `[in code](nowhere.md)`\n\n```\n[fenced](x.md)\n```\n"
    )
    broken = [b.split(":")[0] for b in broken_links(page, tmp_path)]
    assert broken == ["missing.md", "other.md#nowhere"]


def _scanned() -> list[Path]:
    files = [REPO / name for name in SCANNED_FILES]
    for folder in SCANNED:
        files += [
            p
            for p in (REPO / folder).rglob("*")
            if p.is_file()
            and p.suffix in TEXT_SUFFIXES
            and not any(part in SKIPPED for part in p.parts)
        ]
    return files


def outside_references(text: str) -> list[str]:
    found = [m[0] for m in OUTSIDE.finditer(text)]
    for match in ISSUE.finditer(text):
        line_before = text[: match.start()].rsplit("\n", 1)[-1]
        if not UPSTREAM.search(line_before):
            found.append(match[0])
    return found


def test_no_file_cites_documents_outside_the_repository_or_this_projects_issues() -> None:
    cited = {
        str(path.relative_to(REPO)): refs
        for path in _scanned()
        if (refs := outside_references(path.read_text(errors="replace")))
    }
    assert not cited, cited


def test_the_reference_check_tells_ours_from_upstream_ones() -> None:
    spec, stack, issue = "SPEC" + ".md", "STACK" + ".md", "issue" + " 18"
    assert outside_references(f"see {spec} section 9") == [spec]
    assert outside_references(f"pinned ({stack})") == [stack]
    assert outside_references(f"{issue}: the page") == [issue]
    assert outside_references(f"with Spark ({issue}'s job)") == [issue]
    assert outside_references(f"the figure of I{issue[1:]}") == [f"I{issue[1:]}"]
    assert outside_references("(BookKeeper " + issue + ")") == []
    assert outside_references("BookKeeper #" + "2614, apache/bookkeeper#" + "1289") == []
    assert outside_references("color: #0a58ca; a SPEC argument") == []
