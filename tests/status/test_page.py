"""The status page in a real browser (Debian's chromium through Playwright) against a live node
under a small workload: it loads clean, shows what the JSON routes say, highlights an old log
with the ledger that pins it, drives GC and the other admin actions behind the token, is
usable by keyboard and passes axe-core, and notices a node that stopped answering.

One browser and one node for the module; the stopped-node test has a node of its own."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import ConsoleMessage, Page, Request, Response

from node.autorecovery.markers import AUDITOR_KEY, TOTALS_KEY
from node.client.model import NodeInfo, node_key
from node.client.sync import SyncClient
from node.storage.entrylog import read_ledgers_map
from tests.client.conftest import etcd
from tests.harness.etcd import EtcdServer, store_write
from tests.harness.node import NodeProcess
from tests.status.browser import DESKTOP, PHONE, SCREENSHOTS, axe_findings, browser

TOKEN = "status-page-token"
POLL_MS = 300  # the page's poll period here (?poll=): the tests wait a few of them at most
STREAM = "orders"
PAYLOAD = b"p" * 2000
NODE_ENV = {
    "NODE_ADMIN_TOKEN": TOKEN,
    "NODE_LOG_SIZE_LIMIT": str(64 * 1024),  # many small logs: a map worth the name
    "NODE_MAX_ENTRY_SIZE": str(16 * 1024),
    "NODE_FLUSH_INTERVAL_MS": "100",  # entries reach entry logs at once
    "NODE_STATUS_HISTORY_INTERVAL_S": "0.5",
    # Retention must run only when a test asks (the daily hour could fall inside the run).
    "NODE_RETENTION_SCHEDULER_ENABLED": "false",
    # The summary's streams: "orders" (its "audit" cursor never acknowledges: the largest
    # backlog) and one other, whatever the test of many streams adds.
    "NODE_METRICS_MAX_STREAMS": "2",
}
OLD_S = 90 * 24 * 3600  # how old the test makes one log
STREAM_PAGE = 50  # streams per page of the page's full list (status.js)

__all__ = ["browser", "etcd"]  # fixtures: chromium, the session's etcd for the replicated node


@pytest.fixture(autouse=True)
def no_blocking_io_on_the_loop() -> Iterator[None]:
    """Replaces the suite's blockbuster check here: the node runs in its own process, and
    Playwright's sync API runs an event loop on this thread that blockbuster would take for
    the node's."""
    yield


def _call(
    node: NodeProcess,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    token: str | None = TOKEN,
) -> Any:
    headers = {"Content-Type": "application/json" if raw is None else "application/octet-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(f"{node.url}{path}", data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read()
        return json.loads(text) if text else None


class Workload:
    """Appends to a stream, reads, and acknowledges with one of its two cursors, until paused.
    Errors (a read-only node while a test turns it on) are counted, not raised."""

    def __init__(self, node: NodeProcess, pinner: int) -> None:
        self.node, self.pinner = node, pinner
        self.lock = threading.Lock()  # held for each step: pausing waits for the current one
        self.stopped = threading.Event()
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name="status-workload", daemon=True)

    def _run(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                try:
                    appended = _call(
                        self.node, "POST", f"/api/v1/streams/{STREAM}/entries", raw=PAYLOAD
                    )
                    self.node.get_bytes(f"/api/v1/ledgers/{self.pinner}/entries/0")
                    _call(
                        self.node,
                        "POST",
                        f"/api/v1/streams/{STREAM}/cursors/app/ack",
                        {"position": appended["position"]},
                    )
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    self.errors += 1
            time.sleep(0.05)

    def pause(self) -> threading.Lock:
        """``with workload.pause():`` no request is in flight or starts."""
        return self.lock


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    proc = NodeProcess(tmp_path_factory.mktemp("status") / "data", env=NODE_ENV)
    proc.start()
    try:
        yield proc
    finally:
        assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def world(node: NodeProcess) -> Iterator[dict[str, Any]]:
    """A stream whose "audit" cursor never acknowledges, a plain closed ledger that nobody
    deletes in a log the test makes 90 days old, and the workload running."""
    _call(
        node,
        "PUT",
        f"/api/v1/streams/{STREAM}",
        {"minLedgerRolloverTimeMinutes": 0, "maxEntriesPerLedger": 20},
    )
    for cursor in ("audit", "app"):
        _call(node, "PUT", f"/api/v1/streams/{STREAM}/cursors/{cursor}", {"start": "earliest"})
    pinner = _call(node, "POST", "/api/v1/ledgers", {})["ledgerId"]
    for _ in range(30):  # ~60 KiB: most of one 64 KiB log
        _call(node, "POST", f"/api/v1/ledgers/{pinner}/entries", raw=PAYLOAD * 1)
    _call(node, "POST", f"/api/v1/ledgers/{pinner}/close")
    workload = Workload(node, pinner)
    workload.thread.start()
    ledgers_dir = node.data_dir / "ledgers"
    aged = None
    deadline = time.monotonic() + 20
    while aged is None and time.monotonic() < deadline:
        time.sleep(0.2)
        sealed = [
            (sizes.get(pinner, 0), path)
            for path in sorted(ledgers_dir.glob("*.log"))
            if (sizes := read_ledgers_map(path)) is not None
        ]
        best = max(sealed, default=(0, None), key=lambda item: item[0])
        if best[0] > 0:
            aged = best[1]
    assert aged is not None, "no sealed log holds the pinning ledger"
    then = time.time() - OLD_S
    os.utime(aged, (then, then))  # sealed: nothing writes it again, so it stays this old
    try:
        yield {"pinner": pinner, "aged_log": aged.stem, "workload": workload}
    finally:
        workload.stopped.set()
        workload.thread.join(10)


class Watched:
    """A page with what went wrong on it recorded: console errors, page errors, failed
    requests and error answers, requests to anywhere but the node."""

    def __init__(self, page: Page, origin: str) -> None:
        self.page = page
        self.origin = origin
        self.console_errors: list[str] = []
        self.failed: list[str] = []
        self.foreign: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.console_errors.append(f"pageerror: {error}"))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url}: {r.failure}"))
        page.on("response", self._response)
        page.on("request", self._request)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            self.console_errors.append(f"{message.type}: {message.text}")

    def _response(self, response: Response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.url}: HTTP {response.status}")

    def _request(self, request: Request) -> None:
        if not request.url.startswith(self.origin) and not request.url.startswith("data:"):
            self.foreign.append(request.url)


def _open(
    browser: Any, node: NodeProcess, viewport: dict[str, int] = DESKTOP, **context: Any
) -> Watched:
    page = browser.new_context(viewport=viewport, **context).new_page()
    page.set_default_timeout(10_000)
    watched = Watched(page, node.url)
    page.goto(f"{node.url}/?poll={POLL_MS}")  # / redirects to /status, the query kept
    page.wait_for_selector("#updated[datetime]")
    return watched


def _shot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


AT_REST_S = 0.5  # the adds counter unchanged this long: no append of the workload is left
AT_REST_TIMEOUT_S = 30.0


def _adds_at_rest(node: NodeProcess) -> None:
    """Until the node's adds counter holds still: an append the workload gave up on (its
    client timed out on a loaded machine) may still complete after the pause began."""
    deadline = time.monotonic() + AT_REST_TIMEOUT_S
    last = node.get_json("/api/v1/status/summary")["counters"]["adds"]
    while time.monotonic() < deadline:
        time.sleep(AT_REST_S)
        now = node.get_json("/api/v1/status/summary")["counters"]["adds"]
        if now == last:
            return
        last = now
    raise AssertionError(f"the node's adds kept moving for {AT_REST_TIMEOUT_S} s while paused")


def _updated_after(page: Page, after_ms: float) -> None:
    """Wait for a poll that started after ``after_ms`` (epoch ms) to be rendered."""
    # Functions, not expression strings: the page's CSP forbids eval, which strings need.
    page.wait_for_function(
        "after => { const t = document.getElementById('updated').dateTime;"
        " return t && new Date(t).getTime() > after; }",
        arg=after_ms + POLL_MS,
    )


def _until_agreed(
    watched: Watched,
    node: NodeProcess,
    summary: dict[str, Any],
    differences: Callable[[dict[str, Any]], list[tuple[str, Any, Any]]],
    route: str = "/api/v1/status/summary",
) -> dict[str, Any]:
    """The answer of ``route`` (``summary``: as last read) the page agrees with. Some
    figures move with no request (a timed checkpoint writes the WAL and may start an entry
    log, retention drops a ledger on its own timer): on a difference the page is compared
    again against an answer read before its next refresh, until both agree (AssertionError
    naming the differences past AT_REST_TIMEOUT_S, with the time of the page's last answer
    and the errors it logged)."""
    page = watched.page
    deadline = time.monotonic() + AT_REST_TIMEOUT_S
    while differ := differences(summary):
        if time.monotonic() >= deadline:
            updated = page.locator("#updated").get_attribute("datetime")
            raise AssertionError(
                f"{differ}; page updated at {updated}, errors {watched.console_errors}"
            )
        asked_ms = time.time() * 1000
        summary = node.get_json(route)
        _updated_after(page, asked_ms)
    return summary


def test_the_page_loads_with_no_console_error_and_no_failed_request(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    desktop = _open(browser, node)
    assert desktop.page.url.endswith("/status?poll=300"), desktop.page.url
    _updated_after(desktop.page, time.time() * 1000 + 3 * POLL_MS)  # a few polls, under load
    assert desktop.page.locator("h1").inner_text().startswith("Storage node")
    assert desktop.page.locator("#down").is_hidden()
    _shot(desktop.page, "desktop")
    phone = _open(browser, node, PHONE)
    _updated_after(phone.page, time.time() * 1000)
    # Nothing wider than the phone's screen: the page reflows instead of scrolling sideways.
    width = phone.page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the page is {width} px wide on a {PHONE['width']} px phone"
    _shot(phone.page, "phone")
    for watched in (desktop, phone):
        assert watched.console_errors == []
        assert watched.failed == []
        assert watched.foreign == [], "the page loaded something from elsewhere"
        watched.page.context.close()


def _field(page: Page, selector: str) -> Any:
    raw = page.locator(selector).first.get_attribute("data-value")
    assert raw is not None, f"{selector} has no value"
    return json.loads(raw)


def test_its_numbers_equal_the_json_apis(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    watched = _open(browser, node)
    page = watched.page
    fields = [
        "counters.adds",
        "counters.reads",
        "counters.addBytes",
        "counters.readBytes",
        "counters.rejectedAdds",
        "gc.runs",
        "gc.failures",
        "gc.knownLogs",
        "gc.reclaimedBytes",
        "retention.runs",
        "offload.runs",
        "offload.offloadedLedgers",
        "wal.groupWrites",
        "wal.kind",
        "state",
        "version",
    ]

    def differences(summary: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        differ = []
        for name in fields:
            expected = summary
            for key in name.split("."):
                expected = expected[key]
            shown = _field(page, f'[data-src="summary"][data-field="{name}"]')
            if shown != expected:
                differ.append((name, shown, expected))
        adds = summary["counters"]["adds"]
        if (text := page.locator('[data-field="counters.adds"]').inner_text()) != f"{adds:,}":
            differ.append(("counters.adds as text", text, adds))
        return differ

    def logs_differ(logs: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        shown = _field(page, '[data-src="entrylogs"][data-field="logs.length"]')
        differ = [] if shown == len(logs["logs"]) else [("logs.length", shown, len(logs["logs"]))]
        for log in logs["logs"]:
            if (found := page.locator(f'#logmap [data-log="{log["logId"]}"]').count()) != 1:
                differ.append((f"log {log['logId']} on the map", found, 1))
        return differ

    def backlogs_differ(summary: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        cursors = {c["name"]: c for c in summary["streams"][0]["cursors"]}
        assert cursors["audit"]["backlogEntries"] > 0
        differ = []
        for name, cursor in cursors.items():
            row = f'#streams tr[data-cursor="{name}"] [data-field="backlogEntries"]'
            if (shown := _field(page, row)) != cursor["backlogEntries"]:
                differ.append((name, shown, cursor["backlogEntries"]))
        return differ

    with world["workload"].pause():
        # The last add's checkpoint (flush_interval_ms 100 ms), and two idle history intervals
        # (0.5 s): the newest samples, on the page and in the route, are then both at rest.
        time.sleep(1.2)
        _adds_at_rest(node)
        paused_ms = time.time() * 1000
        _updated_after(page, paused_ms)
        summary = node.get_json("/api/v1/status/summary")
        logs = node.get_json("/api/v1/status/entrylogs")
        history = node.get_json("/api/v1/status/history")
        # Compared while still paused: with the workload on, the page's poll and the test's
        # read never see the same counters.
        summary = _until_agreed(watched, node, summary, differences)
        # Without a metadata store the header names the node by its WAL node id.
        assert _field(page, "#node-id") == str(summary["nodeId"])
        assert summary["replication"]["enabled"] is False
        assert page.locator("#replication-off").is_visible()
        assert page.locator("#replication-on").is_hidden()
        _until_agreed(watched, node, logs, logs_differ, "/api/v1/status/entrylogs")
        _until_agreed(watched, node, summary, backlogs_differ)
        latest = history["samples"][-1]
        assert _field(page, '#charts [data-field="addsPerSecond"]') == latest["addsPerSecond"] == 0
    page.context.close()


def test_a_log_made_old_is_highlighted_with_the_ledger_that_pins_it(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    page = _open(browser, node).page
    log_id = world["aged_log"]
    first = page.locator("#pinned > li").first
    assert first.get_attribute("data-log") == log_id
    assert "90.0 d old" in first.inner_text()
    pin = first.locator(f'li[data-ledger="{world["pinner"]}"]')
    assert pin.get_attribute("data-reason") == "not_deleted"
    assert "kept until a client deletes it" in pin.inner_text()
    assert "pinned" in (page.locator(f'#logmap [data-log="{log_id}"]').get_attribute("class") or "")
    # The stream's never-acknowledging cursor is named for the logs it pins.
    backlog = page.locator('#pinned li[data-reason="cursor_backlog"]').first
    assert "cursor audit" in backlog.inner_text()
    page.context.close()


def _text_becomes(page: Page, selector: str, text: str) -> None:
    page.wait_for_function(
        "([sel, text]) => document.querySelector(sel).textContent === text", arg=[selector, text]
    )


def test_what_the_page_says_means_what_it_says(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    """Compaction "running" only while one runs; each log shaded by its own
    size; only logs past the pinned horizon outlined; the checkpoint as when and how much;
    the graphs' restart said; the disk-pressure thresholds of retention (item 9)."""
    deadline = time.monotonic() + 30
    # A young sealed log that the never-acknowledging cursor keeps (the workload seals one
    # every few seconds).
    while all(p["old"] for p in node.get_json("/api/v1/status/entrylogs")["oldestPinned"]):
        assert time.monotonic() < deadline, "no young sealed log holds live data"
        time.sleep(0.2)
    page = _open(browser, node).page
    with world["workload"].pause():
        time.sleep(0.5)  # the last add's checkpoint (flush_interval_ms 100 ms)
        _updated_after(page, time.time() * 1000)
        logs = node.get_json("/api/v1/status/entrylogs")
        summary = node.get_json("/api/v1/status/summary")
        assert logs["oldAfterSeconds"] == (72 * 60 + 24 * 60) * 60  # as shipped: 4 days
        young = [p for p in logs["oldestPinned"] if not p["old"]]
        assert young, logs["oldestPinned"]
        assert [p["logId"] for p in logs["oldestPinned"] if p["old"]] == [world["aged_log"]]
        for listed in young:
            cell = page.locator(f'#logmap [data-log="{listed["logId"]}"]')
            assert "pinned" not in (cell.get_attribute("class") or "")
            assert "old and pinned" not in cell.inner_text()
        aged = page.locator(f'#logmap [data-log="{world["aged_log"]}"]')
        assert "pinned" in (aged.get_attribute("class") or "")
        assert "old and pinned" in aged.inner_text()
        assert "4.0 d" in page.locator("#old-after").inner_text()
        # The shade: live bytes over the log's own size (a 64 KiB log, not 1 GiB).
        shaded = [c for c in logs["logs"] if c["usage"] is not None and c["liveBytes"]]
        assert shaded
        for c in shaded:
            assert c["usage"] == min(1.0, c["liveBytes"] / c["sizeBytes"])
            style = page.locator(f'#logmap [data-log="{c["logId"]}"]').get_attribute("style")
            assert f"--usage: {c['usage']:.3f}" in (style or "")
        assert max(c["usage"] for c in shaded) > 0.1  # would be < 0.07 against 1 GiB
        # The checkpoint: when, and what a crash would replay; the position in the tooltip.
        wal = summary["wal"]
        checkpoint = page.locator("#wal-checkpoint")
        assert wal["lastCheckpointMs"] is not None
        assert " ago; " in checkpoint.inner_text()
        assert checkpoint.get_attribute("title") == f"WAL position {wal['lastCheckpoint']}"
        assert "a restart starts these graphs empty" in page.locator("#history-note").inner_text()
        retention = summary["retention"]
        assert retention["diskPressure"] == "none"
        thresholds = page.locator("#retention-thresholds").inner_text()
        assert "disk_max_used_space_ratio" in thresholds
        assert "disk_space_clean_forcibly_ratio" in thresholds
        assert "every 30 s" in thresholds
        assert page.locator("#retention-pressure").inner_text() == "none"
    # Compaction: "enabled" while not suspended (nothing compacts on this node now).
    assert summary["gc"]["details"]["compactingLog"] is None
    assert page.locator("#gc-suspension").inner_text() == "enabled"
    suspend = {"suspendMajor": True, "suspendMinor": True}
    _call(node, "PUT", "/api/v1/bookie/gc/suspend_compaction", suspend)
    try:
        _text_becomes(page, "#gc-suspension", "suspended")
    finally:
        resume = {"resumeMajor": True, "resumeMinor": True}
        _call(node, "PUT", "/api/v1/bookie/gc/resume_compaction", resume)
    _text_becomes(page, "#gc-suspension", "enabled")
    page.context.close()


def _tab_to(page: Page, selector: str, limit: int = 60) -> None:
    """Press Tab until ``selector`` has the focus, as a keyboard user would."""
    for _ in range(limit):
        page.keyboard.press("Tab")
        if page.evaluate(f"document.activeElement.matches({json.dumps(selector)})"):
            return
    raise AssertionError(f"{selector} is not reachable with Tab")


def _results(page: Page) -> str:
    return page.locator("#results li").first.inner_text()


def test_a_forced_gc_from_the_page_by_keyboard_moves_the_gc_counters(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    page = _open(browser, node).page
    before = node.get_json("/api/v1/status/summary")["gc"]["runs"]
    page.locator("#token").focus()
    page.keyboard.type(TOKEN)
    _tab_to(page, 'button[data-action="gc"]')
    page.keyboard.press("Enter")
    dialog = page.locator("#confirm")
    assert dialog.is_visible() and "garbage collection" in dialog.inner_text()
    assert page.evaluate("document.activeElement.id") == "confirm-cancel"  # the safe default
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden")
    # The dialog's close event comes after Escape returns: wait for what it does.
    page.wait_for_function(
        "() => document.querySelector('#results li').textContent.includes('cancelled')"
    )
    assert "Force GC: cancelled" in _results(page)
    assert page.evaluate("document.activeElement.dataset.action") == "gc"  # focus came back
    assert node.get_json("/api/v1/status/summary")["gc"]["runs"] == before
    page.keyboard.press("Enter")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "confirm-ok"
    page.keyboard.press("Enter")
    page.wait_for_function(
        "() => document.querySelector('#results li').textContent.includes('done')"
    )
    assert "Force GC: done — Triggered GC" in _results(page)
    deadline = time.monotonic() + 15
    while node.get_json("/api/v1/status/summary")["gc"]["runs"] <= before:
        assert time.monotonic() < deadline, "the forced GC did not run"
        time.sleep(0.1)
    runs = node.get_json("/api/v1/status/summary")["gc"]["runs"]
    page.wait_for_function(
        "runs => Number(document.getElementById('gc-runs').dataset.value) >= runs", arg=runs
    )
    assert int(page.locator("#gc-runs").inner_text()) >= before + 1
    page.context.close()


def _act(page: Page, action: str) -> str:
    count = page.locator("#results li:not(.empty)").count()
    page.locator(f'button[data-action="{action}"]').click()
    page.locator("#confirm-ok").click()
    page.wait_for_function(
        "n => document.querySelectorAll('#results li:not(.empty)').length > n", arg=count
    )
    return _results(page)


def test_with_a_token_set_actions_without_it_are_refused_and_shown_as_such(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    page = _open(browser, node).page
    assert page.locator("#token").input_value() == ""
    refused = _act(page, "retention")
    assert "Run retention: refused (HTTP 401)" in refused and "Enter the admin token" in refused
    page.fill("#token", "not-the-token")
    assert "Run retention: refused (HTTP 403) — forbidden" in _act(page, "retention")
    assert node.get_json("/api/v1/status/summary")["retention"]["runs"] == 0
    page.fill("#token", TOKEN)
    assert page.evaluate("sessionStorage.length") == 1  # kept for this tab only
    assert "Run retention: done — deleted 0 ledgers" in _act(page, "retention")
    assert "Run offload: done — offloaded 0" in _act(page, "offload")
    assert "Suspend compaction: done" in _act(page, "suspend")
    page.wait_for_function(
        "() => document.getElementById('gc-suspension').textContent.includes('suspended')"
    )
    assert "Resume compaction: done" in _act(page, "resume")
    assert "Read-only on: done" in _act(page, "readonly-on")
    page.wait_for_function("() => document.getElementById('state').textContent === 'read-only'")
    assert "Read-only off: done" in _act(page, "readonly-off")
    page.wait_for_function("() => document.getElementById('state').textContent === 'writable'")
    summary = node.get_json("/api/v1/status/summary")
    assert summary["retention"]["runs"] == 1 and summary["offload"]["runs"] == 1
    assert not summary["gc"]["majorSuspended"] and summary["state"] == "writable"
    page.locator("#token-forget").click()
    assert page.evaluate("sessionStorage.length") == 0
    page.context.close()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_axe_finds_no_serious_accessibility_violation(
    browser: Any, node: NodeProcess, world: dict[str, Any], viewport: dict[str, int]
) -> None:
    watched = _open(browser, node, viewport, bypass_csp=True)
    page = watched.page
    serious, minor, passes = axe_findings(page)
    print("axe: minor findings:", minor or "none")
    assert serious == []
    assert passes > 20, "axe checked next to nothing"
    # Headings in order, every control named.
    levels = page.eval_on_selector_all("h1, h2, h3", "hs => hs.map(h => Number(h.tagName[1]))")
    assert levels[0] == 1 and all(b - a <= 1 for a, b in itertools.pairwise(levels))
    page.context.close()


def test_with_many_streams_the_page_shows_the_largest_backlogs_and_pages_the_rest(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    extra = [f"extra-{i:02d}" for i in range(60)]
    for name in extra:
        _call(node, "PUT", f"/api/v1/streams/{name}", {})
    page = _open(browser, node).page
    _updated_after(page, time.time() * 1000)
    summary = node.get_json("/api/v1/status/summary")
    totals = summary["streamTotals"]
    assert (totals["streams"], totals["shown"]) == (61, 2)
    shown = page.eval_on_selector_all("#streams h3", "hs => hs.map(h => h.dataset.stream)")
    assert shown == [s["name"] for s in summary["streams"]] and shown[0] == STREAM
    totals_text = page.locator("#stream-totals").inner_text()
    assert totals_text.startswith("61 streams, 2 cursors") and "the 2 with" in totals_text

    # The full list: fetched when opened, a page of 50 at a time, in name order.
    page.locator("#all-streams summary").click()
    names = sorted([*extra, STREAM])
    page.wait_for_selector("#all-streams-list li")
    listed = page.eval_on_selector_all(
        "#all-streams-list li", "ls => ls.map(l => l.dataset.stream)"
    )
    assert listed == names[:50]
    assert page.locator("#all-streams-range").inner_text().startswith("1\u201350 of 61")
    assert page.locator("#all-streams-prev").is_disabled()
    page.locator("#all-streams-next").click()
    page.wait_for_function(
        "() => document.getElementById('all-streams-range').textContent.startsWith('51')"
    )
    listed = page.eval_on_selector_all(
        "#all-streams-list li", "ls => ls.map(l => l.dataset.stream)"
    )
    assert listed == names[50:]
    assert page.locator("#all-streams-next").is_disabled()
    _shot(page, "many-streams")
    page.context.close()


def _produce(node: NodeProcess, stream: str, producer: str, sequence: int) -> None:
    headers = {
        "Content-Type": "application/octet-stream",
        "X-Producer-Id": producer,
        "X-Sequence-Id": str(sequence),
        "Authorization": f"Bearer {TOKEN}",
    }
    path = f"{node.url}/api/v1/streams/{stream}/entries"
    request = urllib.request.Request(path, data=b"x", method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status in (200, 201)


def test_a_deduplicating_stream_shows_its_producer_table(
    browser: Any, node: NodeProcess, world: dict[str, Any]
) -> None:
    """Where the page lists streams: deduplication on or off, and for a deduplicating stream
    the producers its table tracks, the duplicates answered and its snapshot's age, as the
    summary gives them (and in the full list)."""
    name = "once"
    _call(node, "PUT", f"/api/v1/streams/{name}", {"deduplication": True})
    # A backlog, so that the summary's streams (the two largest backlogs) include it.
    _call(node, "PUT", f"/api/v1/streams/{name}/cursors/c", {"start": "earliest"})
    for producer, sequence in (("a", 0), ("b", 0), ("a", 1), ("a", 1)):  # the last: a duplicate
        _produce(node, name, producer, sequence)
    summary = node.get_json("/api/v1/status/summary")
    expected = next(s for s in summary["streams"] if s["name"] == name)["deduplication"]
    assert expected == {"duplicates": 1, "producers": 2, "snapshotAgeSeconds": -1}
    page = _open(browser, node).page
    shown = f'#streams h3[data-stream="{name}"] [data-field="deduplication"]'
    page.wait_for_selector(shown)
    assert _field(page, shown) == expected
    text = page.locator(shown).inner_text()
    assert "deduplication on: 2 producers tracked, 1 duplicate answered" in text, text
    assert "no snapshot yet" in text, text
    off = f'#streams h3[data-stream="{STREAM}"] [data-field="deduplication"]'
    assert page.locator(off).inner_text() == "; deduplication off"
    page.locator("#all-streams summary").click()
    listed = f'#all-streams-list li[data-stream="{name}"] [data-field="deduplication"]'
    everything = node.get_json("/api/v1/status/streams?limit=1000")["streams"]
    at = [s["name"] for s in everything].index(name)  # the list is by name: other tests add some
    page.wait_for_selector("#all-streams-list li")
    for offset in range(STREAM_PAGE, at + 1, STREAM_PAGE):
        page.locator("#all-streams-next").click()
        page.wait_for_function(
            "first => document.getElementById('all-streams-range').textContent"
            ".startsWith(first + '\u2013')",
            arg=f"{offset + 1:,}",
        )
    assert _field(page, listed) == expected
    _shot(page, "deduplication")
    page.context.close()


def test_the_page_notices_a_node_that_stopped_answering(browser: Any, tmp_path: Path) -> None:
    lonely = NodeProcess(tmp_path / "data", env={"NODE_STATUS_HISTORY_INTERVAL_S": "0.5"})
    lonely.start()
    try:
        watched = _open(browser, lonely)
        page = watched.page
        assert page.locator("#down").is_hidden()
        lonely.kill()
        stopped_ms = time.time() * 1000
        page.wait_for_selector("#down:not([hidden])", timeout=10_000)
        banner = page.locator("#down").inner_text()
        assert banner.startswith("Node not answering since"), banner
        assert "last answer at" in banner
        assert page.evaluate("document.body.classList.contains('stale')")
        assert time.time() * 1000 - stopped_ms < 10_000
        _shot(page, "stopped-node")
        page.context.close()
    finally:
        lonely.kill()


def test_a_replicated_node_shows_its_registration_and_the_replicas_it_holds(
    browser: Any, etcd: EtcdServer, tmp_path: Path
) -> None:
    """And the fleet as the store says: the registered nodes and their zones, the
    under-replicated ledgers and the last auditor run (none, then the report an audit wrote)."""
    prefix = f"status-{uuid.uuid4().hex[:12]}"
    env = {
        "NODE_METADATA_URL": etcd.url(prefix),
        "NODE_ID": "status-n0",
        "NODE_ZONE": "zone-a",
        "NODE_STATUS_HISTORY_INTERVAL_S": "0.5",
        "NODE_AUTORECOVERY_POLL_S": "0.3",
        "NODE_STATUS_FLEET_CACHE_S": "0.3",
    }
    replicated = NodeProcess(tmp_path / "data", env=env)
    replicated.start()
    try:
        deadline = time.monotonic() + 15
        while not replicated.get_json("/api/v1/status/summary")["replication"]["registered"]:
            assert time.monotonic() < deadline, "the node did not register within 15 s"
            time.sleep(0.05)
        with SyncClient(env["NODE_METADATA_URL"]) as client:
            for _ in range(2):
                ledger = client.create_ledger(ensemble=1, write_quorum=1, ack_quorum=1)
                ledger.add(b"replicated")
                ledger.close()
        # A replicated stream this node owns (it created it): one of one node's replicas.
        one = {"ensemble": 1, "writeQuorum": 1, "ackQuorum": 1}
        put = urllib.request.Request(
            f"{replicated.url}/api/v1/streams/orders",
            data=json.dumps({"replication": one}).encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(put, timeout=10) as reply:
            assert reply.status == 201 and json.loads(reply.read())["owner"] == "status-n0"
        watched = _open(browser, replicated)
        page = watched.page
        assert page.locator("#replication-off").is_hidden()
        page.wait_for_selector('[data-field="replication.replicatedLedgers"][data-value="2"]')
        summary = replicated.get_json("/api/v1/status/summary")["replication"]
        assert summary["registered"] and summary["replicatedLedgers"] == 2
        assert page.locator("#replication-registered").inner_text() == "registered"
        assert (summary["streamsOwned"], summary["streamTakeovers"]) == (1, 0)
        assert summary["streamRequestsForwarded"] == 0
        for name in (
            *("nodeId", "zone", "url", "clusterId", "instanceId", "replicatedLedgers"),
            *("streamsOwned", "streamTakeovers", "streamRequestsForwarded"),
            *("gcReclaimed", "gcOverreplicatedReclaimed", "gcSkipped"),
        ):
            shown = _field(page, f'[data-field="replication.{name}"]')
            assert shown == summary[name], (name, shown, summary)
        assert summary["nodeId"] == "status-n0" and summary["zone"] == "zone-a"
        assert summary["instanceId"] in (tmp_path / "data" / "COOKIE").read_text()

        # No audit yet: said so, not shown as zero under-replicated.
        assert page.locator("#replication-last-audit").inner_text() == "none yet"
        assert _field(page, "#replication-last-audit") is None
        # Another node of the fleet registers in another zone; an audit reports 2 ledgers.
        other = NodeInfo(node_id="status-n1", url="http://n1.example:8080", zone="zone-b")
        store_write(etcd, prefix, node_key("status-n1"), other.encode())
        finished_ms = int(time.time() * 1000) - 60_000
        report = {
            "version": 1,
            "finishedMs": finished_ms,
            "underReplicatedLedgers": 2,
            "underReplicatedFragments": 3,
            "lostNodes": ["status-n7"],
            "decommissioningNodes": [],
        }
        store_write(etcd, prefix, AUDITOR_KEY, report)
        store_write(etcd, prefix, TOTALS_KEY, {"fragments": 5, "entries": 50, "bytes": 5 << 20})
        page.wait_for_selector('#replication-under[data-value="2"]')
        page.wait_for_selector('#fleet-nodes tr[data-node="status-n1"]')
        page.wait_for_selector('#fleet-nodes tr[data-node="status-n7"]')
        # The totals are a key of their own: a poll may land between the two writes.
        page.wait_for_function(
            "document.querySelector('#fleet-note').innerText.includes('5.0 MiB')"
        )
        summary = replicated.get_json("/api/v1/status/summary")["replication"]
        for name in ("underReplicatedLedgers", "underReplicatedFragments", "lostNodes"):
            assert _field(page, f'[data-field="replication.{name}"]') == summary[name], name
        assert "bad" in (page.locator("#replication-under").get_attribute("class") or "")
        assert _field(page, "#replication-last-audit") == finished_ms
        assert "(1 min ago)" in page.locator("#replication-last-audit").inner_text()
        rows = {
            row.get_attribute("data-node"): (
                row.locator('[data-field="zone"]').inner_text(),
                row.locator('[data-field="state"]').inner_text(),
            )
            for row in page.locator("#fleet-nodes tbody tr").all()
        }
        # The audit's lost node is listed too, though the store holds nothing else of it.
        assert rows == {
            "status-n0": ("zone-a", "registered"),
            "status-n1": ("zone-b", "registered"),
            "status-n7": ("(none)", "lost"),
        }
        assert page.locator("#node-id").inner_text() == "status-n0"
        assert "in zone zone-a" in page.locator("#replication-zone").inner_text()
        note = page.locator("#fleet-note").inner_text()
        assert "2 of 3 nodes registered in 2 zones" in note and "5.0 MiB" in note
        assert page.locator("#fleet-error").is_hidden()
        assert page.locator("#fleet-gone").inner_text() == "At the last audit, lost: status-n7."
        _shot(page, "replication")
        page.context.close()
    finally:
        replicated.kill()
