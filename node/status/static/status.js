// The status page: polls the node's JSON routes (documented in /openapi.json) and renders
// them; admin actions call the node's existing admin routes. Plain JavaScript, no build step,
// nothing loaded from elsewhere (the page's Content-Security-Policy forbids it anyway).
"use strict";

(function () {
  const params = new URLSearchParams(location.search);
  // ?poll=ms lets a test or an impatient operator poll faster; never below 250 ms.
  const POLL_MS = Math.max(250, Number(params.get("poll")) || 2000);
  // A poll that takes longer than this counts as "not answering" (a hung node answers nothing).
  const TIMEOUT_MS = Math.max(3000, 2 * POLL_MS);
  const TOKEN_KEY = "storage-node-admin-token";
  // The summary carries only the streams with the largest backlog; the full list comes a page
  // at a time from its own route, when asked for (never polled: it may be thousands long).
  const STREAM_PAGE = 50;
  const HISTORY_CHARTS = [
    { title: "Adds and reads per second", unit: "rate",
      series: [["addsPerSecond", "adds/s"], ["readsPerSecond", "reads/s"]] },
    { title: "Bytes per second", unit: "bytes",
      series: [["addBytesPerSecond", "added/s"], ["readBytesPerSecond", "read/s"]] },
    { title: "Add latency", unit: "latency",
      series: [["addP50Seconds", "p50"], ["addP99Seconds", "p99"]] },
    { title: "WAL fsync latency", unit: "latency",
      series: [["fsyncP50Seconds", "p50"], ["fsyncP99Seconds", "p99"]] },
  ];
  const PIN_REASONS = {
    open_ledger: "open ledger",
    cursor_backlog: "cursor backlog",
    message_ttl: "message TTL",
    retention: "retention",
    offload_deletion_lag: "offload deletion lag",
    not_deleted: "not deleted",
    awaiting_gc: "awaiting GC",
  };
  const ACTIONS = {
    gc: { label: "Force GC", method: "PUT", path: "/api/v1/bookie/gc", body: {},
      confirm: "Run garbage collection now? It checkpoints, deletes entry logs with no live " +
        "ledger and may compact; it reads and writes the disks while it runs." },
    suspend: { label: "Suspend compaction", method: "PUT",
      path: "/api/v1/bookie/gc/suspend_compaction", body: { suspendMajor: true, suspendMinor: true },
      confirm: "Suspend major and minor compaction? Space held by dead data is not reclaimed " +
        "until compaction is resumed." },
    resume: { label: "Resume compaction", method: "PUT",
      path: "/api/v1/bookie/gc/resume_compaction", body: { resumeMajor: true, resumeMinor: true },
      confirm: "Resume major and minor compaction?" },
    retention: { label: "Run retention", method: "POST", path: "/api/v1/retention/run",
      confirm: "Run retention now? Acknowledged ledgers past their streams' retention are " +
        "deleted for good." },
    offload: { label: "Run offload", method: "POST", path: "/api/v1/offload/run",
      confirm: "Run offload now? Eligible closed ledgers are copied to the object store; " +
        "local copies past their deletion lag are dropped." },
    "readonly-on": { label: "Read-only on", method: "PUT", path: "/api/v1/bookie/state/readonly",
      body: { readOnly: true },
      confirm: "Turn read-only mode on? Every add is refused until it is turned off." },
    "readonly-off": { label: "Read-only off", method: "PUT", path: "/api/v1/bookie/state/readonly",
      body: { readOnly: false }, confirm: "Turn read-only mode off? Adds are accepted again." },
  };

  const $ = (selector) => document.querySelector(selector);
  const data = { summary: null, history: null, entrylogs: null };
  let lastAnswer = null; // Date of the last complete poll
  let downSince = null; // Date of the first failed poll in a row

  // --- formatting ---------------------------------------------------------------------------

  const COUNT = new Intl.NumberFormat("en-US");
  function count(n) { return COUNT.format(n); }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? String(Math.round(n)) : n.toFixed(n >= 100 ? 0 : 1)) + " " + units[i];
  }
  function latency(s) {
    if (s === null || s === undefined) return "–";
    const ms = s * 1000;
    return (ms >= 100 ? ms.toFixed(0) : ms >= 10 ? ms.toFixed(1) : ms.toFixed(2)) + " ms";
  }
  function duration(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 3600) return (s / 60).toFixed(0) + " min";
    if (s < 86400) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }
  function rate(n) { return n === null || n === undefined ? "–" : n.toFixed(n >= 100 ? 0 : 1); }
  function clock(date) { return date.toLocaleTimeString("en-GB", { hour12: false }); }
  function time(ms) { return ms ? new Date(ms).toLocaleString("en-GB", { hour12: false }) : "never"; }
  function pct(x) { return (x * 100).toFixed(1) + "%"; }
  const FORMATS = { count, bytes, latency, duration, time, rate, percent: pct };

  function format(value, how) {
    if (value === null || value === undefined) return "–";
    const f = FORMATS[how];
    return f ? f(value) : String(value);
  }

  function lookup(object, path) {
    return path.split(".").reduce((o, key) => (o === null || o === undefined ? o : o[key]), object);
  }

  // An element showing a value from the JSON keeps the raw value beside its text: the tests
  // compare data-value with what the route answers, and the text with its formatting.
  function show(el, value, how) {
    el.textContent = format(value, how || el.dataset.format);
    el.dataset.value = JSON.stringify(value === undefined ? null : value);
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  function badge(node, text, kind) {
    node.textContent = text;
    node.className = "badge " + kind;
  }

  // --- polling ------------------------------------------------------------------------------

  async function getJson(path) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      const response = await fetch(path, { signal: abort.signal, cache: "no-store" });
      if (!response.ok) {
        const error = new Error(`${path}: HTTP ${response.status}`);
        error.answered = true;
        throw error;
      }
      return await response.json();
    } finally {
      clearTimeout(timer);
    }
  }

  async function refresh() {
    const [summary, history, entrylogs] = await Promise.all([
      getJson("/api/v1/status/summary"),
      getJson("/api/v1/status/history"),
      getJson("/api/v1/status/entrylogs"),
    ]);
    Object.assign(data, { summary, history, entrylogs });
    lastAnswer = new Date();
    downSince = null;
    render();
  }

  async function poll() {
    try {
      await refresh();
    } catch (error) {
      if (error.answered) {
        noteDown(`The node answers with errors (${error.message}).`);
      } else {
        downSince = downSince || new Date();
        noteDown(null);
      }
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  function noteDown(message) {
    const banner = $("#down");
    const last = lastAnswer ? `; last answer at ${clock(lastAnswer)}` : "";
    banner.textContent = message ||
      `Node not answering since ${clock(downSince)}${last}. Retrying every ${POLL_MS / 1000} s; ` +
      "the figures below are from the last answer.";
    banner.hidden = false;
    document.body.classList.add("stale");
    badge($("#state"), message ? "errors" : "not answering", "bad");
  }

  // --- rendering ----------------------------------------------------------------------------

  function render() {
    const s = data.summary;
    $("#down").hidden = true;
    document.body.classList.remove("stale");
    const updated = $("#updated");
    updated.textContent = clock(lastAnswer);
    updated.dateTime = lastAnswer.toISOString();
    for (const node of document.querySelectorAll("[data-src][data-field]")) {
      const source = data[node.dataset.src];
      if (source) show(node, lookup(source, node.dataset.field));
    }
    // Each section on its own: one that throws (logged) must not leave the sections after
    // it showing the previous answer under a fresh "updated" time.
    const sections = [
      () => renderName(s),
      () => renderState(s),
      () => renderDisks(s),
      () => renderWal(s.wal, s.nowMs),
      () => {
        $("#history-note").textContent = "Kept in the node's memory since it started " +
          `(${time(s.startedMs)}): a restart starts these graphs empty.`;
        renderCharts(data.history);
      },
      () => renderLogs(data.entrylogs),
      () => renderGc(s.gc),
      () => renderStreams(s.streams, s.streamTotals),
      () => renderLifecycle(s),
      () => renderAudit(s.audit),
      () => renderReplication(s.replication),
    ];
    for (const section of sections) {
      try {
        section();
      } catch (error) {
        console.error("a section of the status page failed to render", error);
      }
    }
    $("#token-hint").dataset.required = String(s.adminTokenRequired);
  }

  // The node as the fleet knows it (n0, n1, ...) when it has a metadata store; the WAL's
  // numeric node id otherwise (and in the tooltip).
  function renderName(s) {
    const name = s.replication.enabled && s.replication.nodeId ? s.replication.nodeId : String(s.nodeId);
    const node = $("#node-id");
    node.textContent = name;
    node.dataset.value = JSON.stringify(name);
    node.title = `WAL node id ${s.nodeId}`;
    document.title = `Storage node ${name} status`;
  }

  function renderState(s) {
    const kinds = { writable: "ok", read_only: "warn", shutting_down: "bad", starting: "warn" };
    badge($("#state"), s.state.replace("_", "-"), kinds[s.state] || "warn");
    const reason = $("#read-only-reason");
    reason.hidden = !s.readOnlyReason;
    reason.textContent = s.readOnlyReason ? "Read-only: " + s.readOnlyReason : "";
  }

  function renderDisks(s) {
    const w = s.watermarks;
    const list = $("#disks");
    list.replaceChildren();
    for (const disk of s.disks) {
      const level = disk.usage >= w.readOnly ? "bad" : disk.usage >= w.warn ? "warn"
        : disk.usage >= w.gc ? "gc" : "ok";
      const bar = el("div", { class: "bar " + level });
      const fill = el("div", { class: "fill" });
      fill.style.width = pct(Math.min(1, disk.usage));
      bar.append(fill);
      for (const [name, mark] of [["GC", w.gc], ["warn", w.warn], ["read-only", w.readOnly]]) {
        if (mark > 1) continue;
        const tick = el("span", { class: "tick", title: `${name} watermark ${pct(mark)}` });
        tick.style.left = pct(mark);
        bar.append(tick);
      }
      const figure = el("span", { class: "figure", "data-field": "usage",
        text: `${pct(disk.usage)} of ${bytes(disk.totalBytes)}` });
      figure.dataset.value = JSON.stringify(disk.usage);
      list.append(el("li", { "data-dir": disk.dir },
        el("span", { class: "name", text: disk.dir }), figure, bar,
        el("span", { class: "sr-only", text: `${level === "ok" ? "below" : "at or above"} the ` +
          `${{ ok: "GC", gc: "GC", warn: "warning", bad: "read-only" }[level]} watermark` })));
    }
    $("#watermarks").textContent = `Watermarks: GC ${pct(w.gc)}, warning ${pct(w.warn)}, ` +
      `read-only ${pct(w.readOnly)} (writable again below ${pct(w.writableAgain)}).`;
  }

  function renderWal(wal, nowMs) {
    // The WAL position (journal file:offset) means nothing to an operator: when, and how
    // much a start after a crash would replay; the position stays in the tooltip.
    const checkpoint = $("#wal-checkpoint");
    const since = wal.sinceCheckpointBytes ? `${bytes(wal.sinceCheckpointBytes)} written since ` +
      "(replayed from the WAL after a crash)" : "nothing written since";
    checkpoint.textContent = (wal.lastCheckpointMs === null ? "none since start" :
      `${duration(Math.max(0, nowMs - wal.lastCheckpointMs) / 1000)} ago`) + `; ${since}`;
    checkpoint.title = `WAL position ${wal.lastCheckpoint}`;
    checkpoint.dataset.value = JSON.stringify(wal.lastCheckpointMs);
    badge($("#wal-health"), wal.healthy ? "healthy" : "unhealthy", wal.healthy ? "ok" : "bad");
    const problem = $("#wal-problem");
    problem.hidden = !wal.problem;
    problem.textContent = wal.problem || "";
    const ring = $("#wal-ring");
    ring.hidden = wal.ringCapacityBytes === null;
    if (wal.ringCapacityBytes !== null) {
      ring.textContent = `Ring: ${bytes(wal.ringUsedBytes)} of ${bytes(wal.ringCapacityBytes)} ` +
        `used, ${wal.blocksInFlight} blocks in flight, ${count(wal.throttledAppends)} throttled ` +
        `and ${count(wal.rejectedAppends)} rejected appends.`;
    }
  }

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
    return node;
  }

  function renderCharts(history) {
    const box = $("#charts");
    box.replaceChildren();
    const samples = history.samples;
    const end = samples.length ? samples[samples.length - 1].timeMs : Date.now();
    // The x axis spans the history held so far (at least ten intervals), up to the window:
    // a node up for a minute shows that minute across the chart, not squeezed at its edge.
    const held = samples.length ? end - samples[0].timeMs : 0;
    const windowMs = Math.min(history.windowSeconds * 1000,
      Math.max(held, 10 * history.intervalSeconds * 1000));
    for (const chart of HISTORY_CHARTS) {
      const width = 300, height = 80;
      let max = null; // null: the window observed nothing (no add, no WAL write)
      for (const sample of samples) {
        for (const [key] of chart.series) {
          if (sample[key] !== null) max = Math.max(max || 0, sample[key]);
        }
      }
      const top = max > 0 ? max * 1.1 : 1;
      const plot = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none",
        "aria-hidden": "true", focusable: "false" });
      plot.append(svg("line", { x1: 0, y1: height - 0.5, x2: width, y2: height - 0.5, class: "axis" }));
      chart.series.forEach(([key], i) => {
        // A null (an interval that observed nothing) breaks the line; a lone point is drawn
        // as a short dash so that it shows at all.
        let run = [];
        const flush = () => {
          if (run.length === 1) run = [[run[0][0] - 2, run[0][1]], [run[0][0] + 2, run[0][1]]];
          if (run.length) {
            plot.append(svg("polyline", { points: run.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`)
              .join(" "), class: "s" + i }));
          }
          run = [];
        };
        for (const p of samples) {
          if (p[key] === null) { flush(); continue; }
          run.push([width - ((end - p.timeMs) / windowMs) * width, height - (p[key] / top) * height]);
        }
        flush();
      });
      const latest = samples.length ? samples[samples.length - 1] : null;
      const legend = el("ul", { class: "series" });
      chart.series.forEach(([key, label], i) => {
        const value = latest ? latest[key] : null;
        const figure = el("span", { "data-field": key, text: format(value, chart.unit) });
        figure.dataset.value = JSON.stringify(value === undefined ? null : value);
        legend.append(el("li", { class: "s" + i }, el("span", { class: "swatch", "aria-hidden": "true" }),
          `${label} `, figure));
      });
      box.append(el("figure", { class: "chart" },
        el("figcaption", {}, el("strong", { text: chart.title }),
          el("span", { class: "scale", text: ` peak ${format(max, chart.unit)} over ` +
            `${duration(windowMs / 1000)}; latest ${history.intervalSeconds} s:` })),
        plot, legend));
    }
  }

  function renderLogs(map) {
    // Every log listed below gets its number; only the old ones are flagged (outlined): a
    // young sealed log holding live data is normal.
    const pinned = new Map(map.oldestPinned.map((p, i) => [p.logId, i + 1]));
    const old = new Set(map.oldestPinned.filter((p) => p.old).map((p) => p.logId));
    $("#old-after").textContent = duration(map.oldAfterSeconds);
    const cells = [...map.logs].sort((a, b) => b.ageSeconds - a.ageSeconds ||
      parseInt(a.logId, 16) - parseInt(b.logId, 16));
    const list = $("#logmap");
    list.replaceChildren();
    for (const log of cells) {
      const usage = log.usage === null ? null : Math.min(1, log.usage);
      const label = `log ${log.logId}: ${duration(log.ageSeconds)} old, ${bytes(log.sizeBytes)}, ` +
        (usage === null ? (log.sealed ? "usage unknown" : "being written") : `${pct(usage)} live`) +
        (pinned.has(log.logId) ? `, ${old.has(log.logId) ? "old and pinned" : "live data"} ` +
          `(#${pinned.get(log.logId)} below)` : "");
      const cell = el("li", { class: "cell" + (old.has(log.logId) ? " pinned" : "") +
        (log.sealed ? "" : " current"), title: label, "data-log": log.logId },
        el("span", { class: "sr-only", text: label }));
      if (usage !== null) cell.style.setProperty("--usage", usage.toFixed(3));
      if (pinned.has(log.logId)) {
        cell.append(el("span", { class: "rank", "aria-hidden": "true", text: String(pinned.get(log.logId)) }));
      }
      list.append(cell);
    }
    const pinnedList = $("#pinned");
    pinnedList.replaceChildren();
    if (!map.oldestPinned.length) {
      pinnedList.append(el("li", { class: "empty", text: "No sealed log holds live data." }));
    } else if (!old.size) {
      pinnedList.append(el("li", { class: "empty", text: "None is old: every sealed log with " +
        `live data is younger than ${duration(map.oldAfterSeconds)}.` }));
    }
    map.oldestPinned.forEach((log, i) => {
      const pins = el("ul", { class: "pins" });
      for (const pin of log.pins) {
        const where = [pin.stream ? `stream ${pin.stream}` : null,
          pin.cursor ? `cursor ${pin.cursor}` : null].filter(Boolean).join(", ");
        pins.append(el("li", { "data-ledger": String(pin.ledgerId), "data-reason": pin.reason },
          el("span", { class: "ledger", text: `ledger ${pin.ledgerId}` }),
          el("span", { class: "size", text: ` ${bytes(pin.bytes)} here ` }),
          el("span", { class: "reason " + pin.reason, text: PIN_REASONS[pin.reason] || pin.reason }),
          el("span", { class: "detail", text: ` ${pin.detail}${where ? ` (${where})` : ""}` })));
      }
      const more = log.liveLedgers > log.pins.length
        ? el("p", { class: "legend", text: `and ${log.liveLedgers - log.pins.length} smaller ledgers` })
        : null;
      pinnedList.append(el("li", { "data-log": log.logId, "data-old": String(log.old) },
        el("p", { class: "head" }, el("span", { class: "rank", text: `#${i + 1}` }),
          el("strong", { text: ` log ${log.logId}` }),
          ` — ${duration(log.ageSeconds)} old, ${count(log.liveLedgers)} live ` +
          (log.liveLedgers === 1 ? "ledger" : "ledgers") + (log.old ? ": old and pinned" : "")),
        pins, more));
    });
  }

  function renderGc(gc) {
    const d = gc.details;
    // "running" only while a compaction runs (the node says which log); otherwise whether
    // the next GC run may compact.
    let compaction = "enabled";
    if (d.compactingLog !== null) compaction = `running (log ${d.compactingLog})`;
    else if (gc.majorSuspended && gc.minorSuspended) compaction = "suspended";
    else if (gc.majorSuspended) compaction = "major suspended, minor enabled";
    else if (gc.minorSuspended) compaction = "minor suspended, major enabled";
    $("#gc-suspension").textContent = compaction;
    $("#gc-force").textContent = gc.inForceGc ? "pending or running" : "none";
    const progress = $("#gc-progress");
    progress.hidden = d.compactingLog === null;
    if (d.compactingLog !== null) {
      progress.textContent = `Compacting log ${d.compactingLog}: ${bytes(d.compactingBytesDone)} done, ` +
        `${bytes(d.compactingBytesLeft)} left.`;
    }
    const errors = $("#gc-errors");
    errors.replaceChildren();
    const entries = Object.entries(d.lastErrors);
    if (entries.length || d.unreadableLogs.length) {
      const list = el("ul", { class: "errors" });
      for (const [log, message] of entries) list.append(el("li", { text: `log ${log}: ${message}` }));
      if (d.unreadableLogs.length) {
        list.append(el("li", { text: `unreadable logs: ${d.unreadableLogs.join(", ")}` }));
      }
      errors.append(el("h3", { text: "Last errors" }), list);
    }
  }

  // Message deduplication (node/streams/dedup.py): whether the stream's appends with producer
  // headers land once, and the producer table this node keeps for it.
  function dedupEl(stream) {
    const d = stream.deduplication;
    let text = "deduplication off";
    if (d) {
      const snapshot = d.snapshotAgeSeconds < 0 ? "no snapshot yet" :
        `snapshot ${duration(d.snapshotAgeSeconds)} old`;
      const of = (n, one) => `${count(n)} ${one}${n === 1 ? "" : "s"}`;
      text = `deduplication on: ${of(d.producers, "producer")} tracked, ` +
        `${of(d.duplicates, "duplicate")} answered, ${snapshot}`;
    }
    const node = el("span", { class: "meta", "data-field": "deduplication", text: `; ${text}` });
    node.dataset.value = JSON.stringify(d);
    return node;
  }

  function renderStreams(streams, totals) {
    const box = $("#streams");
    box.replaceChildren();
    const shown = totals.shown < totals.streams ? ` Below: the ${count(totals.shown)} with ` +
      "the largest backlog (the node's metrics_max_streams); every stream is in the list " +
      "further down." : "";
    $("#stream-totals").textContent = totals.streams ? `${count(totals.streams)} streams, ` +
      `${count(totals.cursors)} cursors: backlog ${count(totals.backlogEntries)} entries ` +
      `(${bytes(totals.backlogBytes)}), ${bytes(totals.retainedBytes)} retained.${shown}` : "";
    $("#stream-totals").dataset.value = JSON.stringify(totals);
    if (!streams.length) box.append(el("p", { text: "No stream." }));
    for (const stream of streams) {
      // A stream may have thousands of cursors: the summary carries the largest backlogs.
      const some = stream.cursors.length < stream.cursorCount ?
        `; ${count(stream.cursors.length)} of ${count(stream.cursorCount)} cursors shown` : "";
      box.append(el("h3", { "data-stream": stream.name }, stream.name,
        el("span", { class: "meta", text: ` — ${stream.ledgers} ledgers, ` +
          `${bytes(stream.retainedBytes)}${some}` }), dedupEl(stream)));
      if (!stream.cursors.length) {
        box.append(el("p", { class: "legend", text: stream.cursorCount ?
          "Its cursors' backlogs are smaller than those shown." :
          "No cursor: retention alone decides." }));
        continue;
      }
      const body = el("tbody");
      for (const cursor of stream.cursors) {
        const backlog = el("td", { "data-field": "backlogEntries",
          text: `${count(cursor.backlogEntries)} (${bytes(cursor.backlogBytes)})` });
        backlog.dataset.value = JSON.stringify(cursor.backlogEntries);
        body.append(el("tr", { "data-stream": stream.name, "data-cursor": cursor.name },
          el("th", { scope: "row", text: cursor.name }), backlog,
          el("td", { text: cursor.backlogEntries ? duration(cursor.oldestUnacknowledgedAgeSeconds) : "–" })));
      }
      const head = el("thead", {}, el("tr", {},
        el("th", { scope: "col", text: "Cursor" }), el("th", { scope: "col", text: "Backlog" }),
        el("th", { scope: "col", text: "Oldest unacked" })));
      box.append(el("table", { class: "cursors" }, head, body));
    }
  }

  let streamOffset = 0;

  async function loadStreamPage(offset) {
    const range = $("#all-streams-range");
    let page;
    try {
      page = await getJson(`/api/v1/status/streams?offset=${offset}&limit=${STREAM_PAGE}`);
    } catch (error) {
      range.textContent = `The list did not load (${error.message}).`;
      return;
    }
    streamOffset = offset;
    const list = $("#all-streams-list");
    list.replaceChildren();
    list.start = offset + 1;
    for (const stream of page.streams) {
      const backlog = Math.max(0, ...stream.cursors.map((c) => c.backlogEntries));
      list.append(el("li", { "data-stream": stream.name }, stream.name,
        el("span", { class: "meta", text: ` — ${stream.ledgers} ledgers, ` +
          `${bytes(stream.retainedBytes)}, ${stream.cursorCount} cursors, largest backlog ` +
          `${count(backlog)}` }), dedupEl(stream)));
    }
    const last = offset + page.streams.length;
    range.textContent = page.total ? `${count(offset + 1)}–${count(last)} of ` +
      `${count(page.total)}, by name (fetched when opened or paged, not polled).` : "No stream.";
    $("#all-streams-prev").disabled = offset === 0;
    $("#all-streams-next").disabled = last >= page.total;
  }

  function renderLifecycle(s) {
    const r = s.retention;
    const modes = {
      none: ["none", "ok"],
      cleaning: [`cleaning: a data disk is past ${pct(r.cleanAbove)}`, "warn"],
      forced: [`forced: a data disk is past ${pct(r.forcedAbove)}`, "bad"],
    };
    badge($("#retention-pressure"), ...modes[r.diskPressure]);
    $("#retention-pressure").dataset.value = JSON.stringify(r.diskPressure);
    $("#retention-thresholds").textContent = `Fullest data disk ${pct(r.diskUsage)}. Above ` +
      `${pct(r.cleanAbove)} (disk_max_used_space_ratio) retention runs every ${duration(r.pressureRunSeconds)}; above ` +
      `${pct(r.forcedAbove)} (disk_space_clean_forcibly_ratio) it deletes every acknowledged ` +
      "closed ledger, whatever the stream's retention.";
    const error = $("#offload-error");
    error.hidden = !s.offload.lastError;
    error.textContent = s.offload.lastError ? "Last offload error: " + s.offload.lastError : "";
  }

  function renderAudit(audit) {
    const box = $("#audit");
    box.replaceChildren();
    if (!audit) {
      box.append(el("p", { text: "No audit result posted yet." }));
      return;
    }
    const clean = audit.status === "clean";
    const status = el("span", {});
    badge(status, clean ? "clean" : "violations", clean ? "ok" : "bad");
    box.append(el("p", {}, status, ` finished ${time(audit.finishedMs)}`));
    const list = el("ul", { class: "checks" });
    for (const [check, n] of Object.entries(audit.violations)) {
      list.append(el("li", { class: n ? "bad" : "", text: `${check}: ${count(n)} violations` }));
    }
    box.append(list);
  }

  const FLEET_STATES = { registered: ["registered", ""], read_only: ["read-only", "warn"],
    decommissioning: ["decommissioning", "warn"], unregistered: ["unregistered", "bad"],
    lost: ["lost", "bad"] };
  function hhmm(ms) {
    return new Date(ms).toLocaleTimeString("en-GB", { hour: "2-digit", minute: "2-digit", hour12: false });
  }
  function timeEl(ms, text) {
    const node = el("time", { dateTime: new Date(ms).toISOString(), text });
    node.dataset.value = JSON.stringify(ms);
    return node;
  }

  // "2 of 3 copies reachable, needs 2": with striping (ensemble larger than the write
  // quorum) each entry has fewer copies than the ensemble has nodes, so the ensemble is named.
  function copies(d) {
    const needs = `needs ${d.ackQuorum}`;
    return d.ensembleSize === d.writeQuorum
      ? `${d.reachable} of ${d.ensembleSize} copies reachable, ${needs}`
      : `${d.reachable} of ${d.ensembleSize} ensemble nodes reachable (${d.writeQuorum} ` +
        `copies of each entry), ${needs}`;
  }

  function fleetState(node) {
    const [word, kind] = FLEET_STATES[node.state] || [node.state, "warn"];
    const cell = el("td", { "data-field": "state", class: kind });
    cell.append(word);
    if (node.unregisteredSinceMs !== null) {
      cell.append(" since ", timeEl(node.unregisteredSinceMs, clock(new Date(node.unregisteredSinceMs))));
    }
    if (node.decommissioning && node.state !== "decommissioning") cell.append(", decommissioning");
    return cell;
  }

  function fleetDepends(node) {
    const cell = el("td", { "data-field": "depends" });
    if (!node.openLedgerCount) {
      cell.append(node.ledgers ? `no open ledger; copies of ${count(node.ledgers)} closed ` +
        (node.ledgers === 1 ? "ledger" : "ledgers") : "nothing");
      return cell;
    }
    const list = el("ul", { class: "deps" });
    for (const d of node.openLedgers) {
      list.append(el("li", { "data-ledger": String(d.ledgerId) },
        el("strong", { text: `ledger ${d.ledgerId}` }),
        d.stream ? ` (stream ${d.stream})` : "", `: ${copies(d)}`));
    }
    const more = node.openLedgerCount - node.openLedgers.length;
    if (more > 0) list.append(el("li", { text: `and ${count(more)} more open ledgers` }));
    if (node.streams.length) {
      list.append(el("li", { "data-field": "streams", text: `streams: ${node.streams.join(", ")}` }));
    }
    const closed = node.ledgers - node.openLedgerCount;
    if (closed > 0) list.append(el("li", { text: `copies of ${count(closed)} closed ledgers` }));
    cell.append(list);
    return cell;
  }

  function fleetNext(node, fleet, r) {
    const cell = el("td", { "data-field": "next" });
    if (node.state === "unregistered" && node.lostAtMs !== null) {
      cell.append("its ledgers re-replicated from ", timeEl(node.lostAtMs, hhmm(node.lostAtMs)),
        ` unless it returns (lost-node delay ${duration(fleet.lostNodeDelaySeconds)})`);
    } else if (node.state === "unregistered") {
      cell.append("never counted lost: it holds no cookie (retired, or never served here)");
    } else if (node.state === "lost") {
      const audited = (r.lostNodeIds || []).includes(node.id);
      cell.append(audited ? "lost: its ledgers are being re-replicated" :
        "lost: the next audit marks its ledgers for re-replication");
    } else if (node.decommissioning) {
      cell.append("its ledgers are moved to other nodes, then it may leave");
    } else if (node.state === "read_only") {
      cell.append("serves reads; new ledgers go elsewhere");
    } else {
      cell.append("–");
    }
    return cell;
  }

  function renderFleet(r) {
    const fleet = r.fleet;
    const rows = $("#fleet-nodes tbody");
    rows.replaceChildren();
    // Before the fleet view's first read: the registered nodes of the last poll.
    const nodes = fleet && fleet.nodes ? fleet.nodes : (r.nodes || []).map((n) => ({
      id: n.id, zone: n.zone, state: n.state === "readonly" ? "read_only" : "registered",
      registered: true, decommissioning: false, unregisteredSinceMs: null, lostAtMs: null,
      ledgers: 0, openLedgerCount: 0, openLedgers: [], streams: [] }));
    for (const node of nodes) {
      rows.append(el("tr", { "data-node": node.id, "data-state": node.state },
        el("th", { scope: "row" }, el("code", { text: node.id })),
        el("td", { "data-field": "zone", text: node.zone || "(none)" }),
        fleetState(node), fleetDepends(node), fleetNext(node, fleet, r)));
    }
    if (!nodes.length) {
      rows.append(el("tr", {}, el("td", { colSpan: 5, text: "Not read from the store yet." })));
    }
    $("#fleet-at-risk").classList.toggle("bad", Boolean(fleet && fleet.atRiskLedgers));
    $("#fleet-unregistered").classList.toggle("bad", Boolean(fleet && fleet.unregisteredNodes));
    const away = nodes.filter((n) => !n.registered && n.ledgers);
    const risk = $("#fleet-risk");
    risk.hidden = !(fleet && fleet.atRiskLedgers);
    risk.textContent = risk.hidden ? "" : `At risk now: ${count(fleet.atRiskLedgers)} ` +
      `ledgers (${count(fleet.atRiskOpenLedgers)} open) name ${away.map((n) => n.id).join(", ")}, ` +
      "not registered. An audit counts them under-replicated once the lost-node delay is over.";
    const gone = [["lost", r.lostNodeIds], ["decommissioning", r.decommissioningNodeIds]]
      .filter(([, ids]) => ids && ids.length).map(([what, ids]) => `${what}: ${ids.join(", ")}`);
    $("#fleet-gone").hidden = !gone.length;
    $("#fleet-gone").textContent = gone.length ? "At the last audit, " + gone.join("; ") + "." : "";
    // Zones are counted only when nodes declare them: "1 zones" of nodes that name none says nothing.
    const registered = nodes.filter((n) => n.registered);
    const zones = new Set(registered.map((n) => n.zone).filter(Boolean));
    const where = zones.size ? ` in ${count(zones.size)} ${zones.size === 1 ? "zone" : "zones"}` : "";
    const read = fleet && fleet.readMs ? `; the fleet view read ${time(fleet.readMs)} ` +
      `(every ${duration(fleet.cacheSeconds)} at most)` : "";
    $("#fleet-note").textContent = `${count(registered.length)} of ${count(nodes.length)} ` +
      `nodes registered${where}; re-replicated since the cluster began: ` +
      `${count(r.rereplicatedFragments)} fragments, ${count(r.rereplicatedEntries)} entries, ` +
      `${bytes(r.rereplicatedBytes)}. Autorecovery figures read ${time(r.lastAutorecoveryPollMs)}${read}.`;
    const failed = $("#fleet-error");
    const errors = [r.lastAutorecoveryPollError ? "The last read of the store failed " +
      `(${count(r.autorecoveryPollErrors)} so far; the figures are the last read's): ` +
      r.lastAutorecoveryPollError : null,
    fleet && fleet.error ? `The last read of the fleet view failed (the view is the last ` +
      `read's): ${fleet.error}` : null].filter(Boolean);
    failed.hidden = !errors.length;
    failed.textContent = errors.join(" ");
  }

  function renderReplication(r) {
    $("#replication-off").hidden = r.enabled;
    $("#replication-on").hidden = !r.enabled;
    if (!r.enabled) return;
    badge($("#replication-registered"), r.registered ? "registered" : "not registered",
      r.registered ? "ok" : "bad");
    $("#replication-zone").hidden = !r.zone;
    const error = $("#replication-error");
    error.hidden = !r.lastRegistrationError;
    error.textContent = r.lastRegistrationError
      ? "Last registration error: " + r.lastRegistrationError : "";
    $("#replication-under").classList.toggle("bad", r.underReplicatedLedgers > 0);
    // No audit yet is not "0 under-replicated": nobody has looked.
    const audit = $("#replication-last-audit");
    audit.textContent = r.lastAuditorRunMs === null ? "none yet"
      : `${time(r.lastAuditorRunMs)} (${duration(Math.max(0, Date.now() - r.lastAuditorRunMs) / 1000)} ago)`;
    audit.dataset.value = JSON.stringify(r.lastAuditorRunMs);
    renderFleet(r);
  }

  // --- admin actions ------------------------------------------------------------------------

  function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

  function confirmAction(text) {
    const dialog = $("#confirm");
    $("#confirm-text").textContent = text;
    dialog.returnValue = "";
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.showModal();
      $("#confirm-cancel").focus(); // the safe choice has the focus: Enter twice does nothing harmful
    });
  }

  function describe(name, result) {
    if (name === "retention" && result && result.streams) {
      const deleted = Object.values(result.streams).reduce((n, list) => n + list.length, 0);
      return `deleted ${deleted} ledgers`;
    }
    if (name === "offload" && result && result.offloaded) {
      return `offloaded ${result.offloaded.length}, failed ${result.failed.length}, ` +
        `local copies dropped ${result.localDeleted.length}`;
    }
    return typeof result === "string" ? result : JSON.stringify(result);
  }

  function addResult(text, kind) {
    const list = $("#results");
    const empty = list.querySelector(".empty");
    if (empty) empty.remove();
    const item = el("li", { class: kind }, el("time", { text: clock(new Date()) }), " ", text);
    list.prepend(item);
    while (list.children.length > 20) list.lastElementChild.remove();
    return item;
  }

  async function run(name, button) {
    const action = ACTIONS[name];
    if (!(await confirmAction(action.confirm))) {
      addResult(`${action.label}: cancelled.`, "info");
      button.focus();
      return;
    }
    const headers = { "Content-Type": "application/json" };
    if (token()) headers.Authorization = `Bearer ${token()}`;
    button.disabled = true;
    try {
      const response = await fetch(action.path, { method: action.method, headers,
        body: action.body === undefined ? null : JSON.stringify(action.body) });
      const text = await response.text();
      let body = text;
      try { body = JSON.parse(text); } catch (e) { /* a plain-text answer */ }
      if (response.ok) {
        addResult(`${action.label}: done — ${describe(name, body)}`, "ok");
      } else {
        const refused = response.status === 401 || response.status === 403;
        const why = body && body.code ? `${body.code}: ${body.message}` : text;
        addResult(`${action.label}: ${refused ? "refused" : "failed"} (HTTP ${response.status}) — ${why}` +
          (response.status === 401 ? ". Enter the admin token above." : ""), refused ? "refused" : "bad");
      }
    } catch (error) {
      addResult(`${action.label}: no answer from the node (${error.message}).`, "bad");
    } finally {
      button.disabled = false;
      button.focus();
      // Refresh at once rather than at the next tick (a failure is the tick's to report).
      refresh().catch(() => {});
    }
  }

  // --- start --------------------------------------------------------------------------------

  function start() {
    const input = $("#token");
    input.value = token();
    input.addEventListener("input", () => {
      if (input.value) sessionStorage.setItem(TOKEN_KEY, input.value);
      else sessionStorage.removeItem(TOKEN_KEY);
    });
    $("#token-form").addEventListener("submit", (event) => event.preventDefault());
    $("#token-forget").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      input.value = "";
      input.focus();
    });
    $("#all-streams").addEventListener("toggle", (event) => {
      if (event.target.open) loadStreamPage(streamOffset);
    });
    $("#all-streams-prev").addEventListener("click",
      () => loadStreamPage(Math.max(0, streamOffset - STREAM_PAGE)));
    $("#all-streams-next").addEventListener("click", () => loadStreamPage(streamOffset + STREAM_PAGE));
    for (const button of document.querySelectorAll("[data-action]")) {
      button.addEventListener("click", () => run(button.dataset.action, button));
    }
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
