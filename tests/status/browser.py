"""Debian's chromium driven by Playwright for Python, as the status page's tests use it: no
browser download (``playwright install`` is never run), so a missing chromium, playwright or
axe-core fails the tests with what to run, never skips them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags chromium stalls on a closed network (it waits for
# its component updater and variations service); the rest keep it quiet and headless.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
AXE = HERE / "node_modules" / "axe-core" / "axe.min.js"
SCREENSHOTS = HERE / "screenshots"  # git-ignored; the tests print where they wrote
DESKTOP = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}


def chromium_path() -> str:
    found = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if found is None:
        pytest.fail("Debian's chromium is missing: run `make tools` (apt-get install chromium)")
    return found


def axe_source() -> str:
    if not AXE.exists():
        pytest.fail(f"{AXE} is missing: run `make test` (npm ci in tests/status)")
    return AXE.read_text()


def launch(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)


def axe_findings(page: Any) -> tuple[list[str], list[str], int]:
    """axe-core's run over ``page`` (opened with ``bypass_csp=True``: axe is injected as a
    script, which the page's Content-Security-Policy would refuse): the serious or critical
    violations, the minor ones, and how many checks passed."""
    page.add_script_tag(content=axe_source())
    result = page.evaluate(
        """() => axe.run(document, {
            runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa",
                                            "best-practice"]},
        })"""
    )
    serious = [
        f"{v['id']} ({v['impact']}): {v['help']} at "
        + "; ".join(n["target"][0] for n in v["nodes"][:3])
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    minor = [
        f"{v['id']} ({v['impact']})"
        for v in result["violations"]
        if v["impact"] not in ("serious", "critical")
    ]
    return serious, minor, len(result["passes"])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One chromium per test module (imported by the modules that use it)."""
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()
