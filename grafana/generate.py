"""The node's Grafana dashboards, generated: `python -m grafana.generate` writes
grafana/dashboards/*.json; `python -m grafana.generate --check` fails when the committed JSON
differs from what this module builds (tests/monitoring runs the same comparison).

Plain JSON (Grafana's dashboard schema, version 39) rather than grafana-foundation-sdk: the
SDK would be one more pinned runtime dependency of the image for what is a few dicts, and the
JSON is what Grafana imports anyway. Every query is proven against a real Prometheus scraping
a live node by tests/monitoring/test_dashboards.py.

Layout after the community BookKeeper dashboards (grafana.com 10262 and the Pulsar ones):
a row of status stats first, then one row per subsystem, rate on the left, latency on the
right. Every panel selects ``instance=~"$instance"`` and uses the ``$datasource`` variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from node.settings import Settings

DASHBOARDS_DIR = Path(__file__).parent / "dashboards"
RULES_FILE = Path(__file__).parent / "alerts" / "storage-node.rules.yml"
PROMETHEUS_RULE = Path(__file__).parent.parent / "manifests" / "monitoring" / "prometheusrule.yaml"
SCHEMA_VERSION = 39
S = '{instance=~"$instance"}'  # every panel's selector
RATE = "[$__rate_interval]"
DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24  # Grafana's grid
# Streams with per-stream series at the node's default (metrics_max_streams), named in panels.
STREAMS_WITH_SERIES = Settings.model_fields["metrics_max_streams"].default


def sel(name: str, extra: str = "") -> str:
    """``storage_node_<name>`` with the instance selector (and more matchers)."""
    inner = f'instance=~"$instance"{"," + extra if extra else ""}'
    return f"storage_node_{name}{{{inner}}}"


def rate(name: str, by: str = "instance", extra: str = "") -> str:
    return f"sum by ({by}) (rate({sel(name, extra)}{RATE}))"


def quantile(q: float, histogram: str, by: str = "instance") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({sel(histogram + '_bucket')}{RATE})))"


@dataclass
class Query:
    expr: str
    legend: str = "{{instance}}"


@dataclass
class Panel:
    title: str
    unit: str
    queries: list[Query]
    description: str = ""
    kind: str = "timeseries"  # or stat, table, bargauge
    width: int = 8
    height: int = 8
    thresholds: list[tuple[float, str]] = field(default_factory=list)  # (from, colour)
    mappings: dict[str, str] = field(default_factory=dict)  # value -> text (stat panels)
    max: float | None = None


@dataclass
class Row:
    title: str
    panels: list[Panel]


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[Row]
    tags: list[str] = field(default_factory=lambda: ["storage-node"])


def q(expr: str, legend: str = "{{instance}}") -> Query:
    return Query(expr, legend)


# --- the three dashboards -----------------------------------------------------------------

STATE_MAPPINGS = {"0": "writable", "1": "read-only"}
RED_AT_1: list[tuple[float, str]] = [(0, "green"), (1, "red")]


def overview() -> Dashboard:
    status = Row(
        "Status",
        [
            Panel(
                "Scrape up",
                "none",
                [q(f"up{S}")],
                "1 while Prometheus scrapes the node (alert StorageNodeDown).",
                kind="stat",
                width=6,
                height=4,
                thresholds=[(0, "red"), (1, "green")],
                mappings={"0": "down", "1": "up"},
            ),
            Panel(
                "Read-only",
                "none",
                [q(f"max by (instance) ({sel('read_only')})")],
                "1 when adds are refused (disk past disk_usage_threshold, or the WAL failed).",
                kind="stat",
                width=6,
                height=4,
                thresholds=RED_AT_1,
                mappings=STATE_MAPPINGS,
            ),
            Panel(
                "Highest disk usage",
                "percentunit",
                [q(f"max by (instance) ({sel('disk_usage_ratio')})")],
                "Of the journal, ledgers and index disks; read-only at 95% by default.",
                kind="stat",
                width=6,
                height=4,
                thresholds=[(0, "green"), (0.85, "orange"), (0.9, "red")],
                max=1,
            ),
            Panel(
                "Oldest entry log",
                "s",
                [q(f"max by (instance) ({sel('entry_log_oldest_age_seconds')})")],
                "Weeks here while the disk fills is the pinned-log incident: see the "
                "lifecycle dashboard and alert StorageNodeEntryLogPinned.",
                kind="stat",
                width=6,
                height=4,
                thresholds=[(0, "green"), (4 * 86_400, "orange"), (7 * 86_400, "red")],
            ),
        ],
    )
    traffic = Row(
        "Throughput and latency",
        [
            Panel(
                "Adds",
                "ops",
                [
                    q(rate("adds_total"), "{{instance}} adds"),
                    q(rate("reads_total"), "{{instance}} reads"),
                ],
                "Entries added and read per second.",
            ),
            Panel(
                "Payload throughput",
                "Bps",
                [
                    q(rate("add_payload_bytes_total"), "{{instance}} in"),
                    q(rate("read_payload_bytes_total"), "{{instance}} out"),
                ],
                "Payload bytes added and read per second.",
            ),
            Panel(
                "HTTP requests by status",
                "reqps",
                [
                    q(
                        rate("http_request_duration_seconds_count", "instance, status"),
                        "{{instance}} {{status}}",
                    )
                ],
                "5xx are failures of the node; 507 is a full disk, 429/503 back-pressure.",
            ),
            Panel(
                "Add latency",
                "s",
                [
                    q(
                        quantile(0.99, "add_latency_seconds", "instance, kind"),
                        "p99 {{kind}} {{instance}}",
                    ),
                    q(
                        quantile(0.5, "add_latency_seconds", "instance, kind"),
                        "p50 {{kind}} {{instance}}",
                    ),
                ],
                "Receipt to durable acknowledgment, single adds and batches.",
                width=12,
            ),
            Panel(
                "Read latency",
                "s",
                [
                    q(
                        quantile(0.99, "read_latency_seconds", "instance, kind"),
                        "p99 {{kind}} {{instance}}",
                    ),
                    q(
                        quantile(0.5, "read_latency_seconds", "instance, kind"),
                        "p50 {{kind}} {{instance}}",
                    ),
                ],
                "Time to serve an entry or a range.",
                width=12,
            ),
            Panel(
                "Throttled and rejected adds",
                "ops",
                [
                    q(rate("throttled_adds_total"), "{{instance}} throttled"),
                    q(rate("rejected_adds_total"), "{{instance}} rejected"),
                ],
                "Adds that waited on a full write cache; rejected after maxThrottleTime.",
            ),
            Panel(
                "WAL fsync p99",
                "s",
                [q(quantile(0.99, "journal_fsync_seconds"))],
                "fdatasync of a WAL group (alert StorageNodeWalFsyncSlow).",
            ),
            Panel(
                "Disk usage",
                "percentunit",
                [
                    q(sel("disk_usage_ratio"), "{{instance}} {{dir}}"),
                    q(
                        f"max by (instance) ({sel('disk_usage_warn_threshold_ratio')})",
                        "{{instance}} warning watermark",
                    ),
                ],
                "Per data dir, against the warning watermark.",
                max=1,
            ),
        ],
    )
    return Dashboard(
        "storage-node-overview",
        "Storage node / Overview",
        "Is it up, writable, fast, and is the disk safe.",
        [status, traffic],
    )


def internals() -> Dashboard:
    wal = Row(
        "WAL (journal or raw-device ring)",
        [
            Panel(
                "Fsync latency",
                "s",
                [
                    q(quantile(0.99, "journal_fsync_seconds"), "p99 {{instance}}"),
                    q(quantile(0.5, "journal_fsync_seconds"), "p50 {{instance}}"),
                ],
                "fdatasync of a WAL group (the raw-device WAL reports O_DIRECT|O_DSYNC writes "
                "as writes with a zero sync).",
            ),
            Panel(
                "Write latency",
                "s",
                [q(quantile(0.99, "journal_write_seconds"), "p99 {{instance}}")],
                "The pwrite of a WAL group or block.",
            ),
            Panel(
                "Group size",
                "none",
                [q(quantile(0.5, "journal_group_records"), "p50 records {{instance}}")],
                "Records per group write: 1 means no group commit is happening.",
            ),
            Panel(
                "Group bytes",
                "bytes",
                [q(quantile(0.5, "journal_group_bytes"), "p50 {{instance}}")],
                "Bytes per group write.",
            ),
            Panel(
                "Queued bytes",
                "bytes",
                [q(sel("journal_queue_bytes"))],
                "Bytes waiting for the next WAL write.",
            ),
            Panel(
                "Raw-device ring use",
                "percentunit",
                [q(f"{sel('wal_ring_used_bytes')} / {sel('wal_ring_capacity_bytes')}")],
                "Trim offset to newest block over the ring; full means appends wait for a "
                "checkpoint (wal_kind=blockdev only).",
                max=1,
            ),
            Panel(
                "Raw-device ring back-pressure",
                "ops",
                [
                    q(rate("wal_throttled_appends_total"), "{{instance}} throttled"),
                    q(rate("wal_rejected_appends_total"), "{{instance}} rejected"),
                ],
                "Appends that waited for room in the ring, and those refused.",
            ),
            Panel(
                "Raw-device blocks",
                "bytes",
                [q(quantile(0.5, "wal_block_bytes"), "p50 {{instance}}")],
                "Bytes per durable block, padding included.",
            ),
            Panel(
                "Blocks in flight",
                "none",
                [q(sel("wal_blocks_in_flight"))],
                "Raw-device WAL blocks written and not yet acknowledged.",
            ),
        ],
    )
    caches = Row(
        "Caches and checkpoints",
        [
            Panel(
                "Write cache",
                "bytes",
                [q(sel("write_cache_bytes"))],
                "Both halves; adds throttle when it is full "
                "(alert StorageNodeWriteCacheThrottling).",
            ),
            Panel(
                "Read cache",
                "bytes",
                [q(sel("read_cache_bytes"))],
                "Bytes in the read-ahead cache.",
            ),
            Panel(
                "Read cache hit ratio",
                "percentunit",
                [
                    q(
                        f"{rate('read_cache_hits_total')} / clamp_min("
                        f"{rate('read_cache_hits_total')} + "
                        f"{rate('read_cache_misses_total')}, 1e-9)"
                    )
                ],
                "Reads served from the read cache.",
                max=1,
            ),
            Panel(
                "Checkpoint duration",
                "s",
                [q(quantile(0.99, "checkpoint_duration_seconds"), "p99 {{instance}}")],
                "Write cache to entry log, fsync, index batch, lastMark.",
            ),
            Panel(
                "Checkpoints",
                "ops",
                [q(rate("checkpoints_total"))],
                "Checkpoints completed per second.",
            ),
            Panel(
                "Request bodies in flight",
                "bytes",
                [q(sel("http_request_body_bytes_in_flight"))],
                "Out of max_request_bytes_in_flight.",
            ),
        ],
    )
    logs = Row(
        "Entry logs and index",
        [
            Panel(
                "Entry logs",
                "none",
                [q(sel("entry_logs"))],
                "Entry log files in the ledgers dir.",
            ),
            Panel(
                "Entry log bytes",
                "bytes",
                [q(sel("entry_log_bytes"))],
                "Bytes of all entry log files.",
            ),
            Panel(
                "Oldest entry log age",
                "s",
                [
                    q(sel("entry_log_oldest_age_seconds"), "{{instance}} age"),
                    q(
                        f"{sel('default_retention_seconds')} + "
                        f"{sel('major_compaction_interval_seconds')}",
                        "{{instance}} retention + major interval",
                    ),
                ],
                "Above the line: a log outlived retention and a major compaction: pinned.",
            ),
            Panel(
                "Entry log usage",
                "none",
                [q(f"sum by (le) ({sel('entry_log_usage_bucket')})", "{{le}}")],
                "Logs by live bytes over size (cumulative buckets).",
                kind="bargauge",
            ),
            Panel(
                "Index",
                "bytes",
                [q(sel("index_size_bytes"))],
                "RocksDB index on disk.",
            ),
            Panel(
                "Index keys",
                "none",
                [q(sel("index_keys"))],
                "Keys of the locations index: one per run of up to 511 entries (RocksDB estimate).",
            ),
            Panel(
                "Ledgers by state",
                "none",
                [q(f"sum by (instance, state) ({sel('ledgers')})", "{{instance}} {{state}}")],
                "Open, closed, fenced, deleted.",
                width=12,
            ),
            Panel(
                "Replayed WAL records",
                "none",
                [q(sel("replayed_records_total"))],
                "At the last start.",
                width=12,
            ),
        ],
    )
    return Dashboard(
        "storage-node-internals",
        "Storage node / Storage internals",
        "WAL, caches, checkpoints, entry logs and index.",
        [wal, caches, logs],
    )


def lifecycle() -> Dashboard:
    gc = Row(
        "Garbage collection and compaction",
        [
            Panel(
                "Since the last successful GC run",
                "s",
                [q(f"time() - {sel('gc_last_success_timestamp_seconds')}")],
                "Compare with gc_interval_seconds (alert StorageNodeGcNotRunning).",
            ),
            Panel(
                "GC runs and failures",
                "none",
                [
                    q(
                        f"sum by (instance) (increase({sel('gc_runs_total')}[1h]))",
                        "{{instance}} runs/h",
                    ),
                    q(
                        f"sum by (instance) (increase({sel('gc_failures_total')}[1h]))",
                        "{{instance}} failures/h",
                    ),
                ],
                "Runs and failed runs in the last hour.",
            ),
            Panel(
                "GC run duration",
                "s",
                [q(sel("gc_last_run_duration_seconds"))],
                "The last run.",
            ),
            Panel(
                "Reclaimed",
                "Bps",
                [q(rate("gc_reclaimed_bytes_total", "instance, by"), "{{instance}} {{by}}")],
                "Disk space given back, by deletion of empty logs or compaction.",
            ),
            Panel(
                "Compaction I/O",
                "Bps",
                [
                    q(rate("gc_compaction_read_bytes_total"), "{{instance}} read"),
                    q(rate("gc_compaction_written_bytes_total"), "{{instance}} written"),
                    q(rate("gc_scanned_bytes_total"), "{{instance}} scanned"),
                ],
                "Bytes compaction read and wrote, and GC's reads of logs without a map "
                "(after a crash; once per log).",
            ),
            Panel(
                "Compactions",
                "none",
                [
                    q(
                        f"sum by (instance, kind) (increase({sel('gc_compactions_total')}[1h]))",
                        "{{instance}} {{kind}}",
                    ),
                    q(
                        f"max by (instance, kind) ({sel('gc_compacting')})",
                        "{{instance}} {{kind}} running",
                    ),
                ],
                "Compaction runs by kind in the last hour, and whether one runs.",
            ),
            Panel(
                "Space amplification",
                "none",
                [q(sel("gc_space_amplification"))],
                "Sealed log bytes over their live bytes (alert StorageNodeSpaceAmplificationHigh).",
                thresholds=[(0, "green"), (1.5, "orange"), (2, "red")],
            ),
            Panel(
                "Unreadable logs",
                "none",
                [q(sel("gc_unreadable_logs"))],
                "Logs GC skipped as unreadable (gc_details names them).",
            ),
            Panel(
                "Ledgers pinning the oldest log",
                "bytes",
                [q(sel("entry_log_oldest_pinning_ledger_bytes"), "{{instance}} ledger {{ledger}}")],
                "Live bytes of the largest ledgers keeping the oldest entry log: delete or "
                "offload them, or find the stream or client that never deletes them.",
                kind="table",
            ),
        ],
    )
    retention = Row(
        "Streams and retention",
        [
            Panel(
                "Since the last retention run",
                "s",
                [q(f"time() - {sel('retention_last_run_timestamp_seconds')}")],
                "Runs at delete_when (or from Airflow); alert StorageNodeRetentionNotRunning.",
            ),
            Panel(
                "Retention deletions",
                "none",
                [
                    q(
                        f"sum by (instance, reason) "
                        f"(increase({sel('retention_deleted_ledgers_total')}[1h]))",
                        "{{instance}} {{reason}}",
                    )
                ],
                "Ledgers deleted in the last hour by why: time, size, disk pressure (all "
                "streams; stream_retention_deleted_* name the streams with series).",
            ),
            Panel(
                "Retention deleted bytes",
                "bytes",
                [q(f"sum by (instance) (increase({sel('retention_deleted_bytes_total')}[1h]))")],
                "Payload bytes deleted in the last hour, all streams.",
            ),
            Panel(
                "Streams and cursors",
                "none",
                [
                    q(sel("streams"), "{{instance}} streams"),
                    q(sel("streams_cursors"), "{{instance}} cursors"),
                ],
                "Every stream and cursor of the node. The panels by stream show the "
                f"{STREAMS_WITH_SERIES} with the largest backlog (metrics_max_streams).",
            ),
            Panel(
                "Retained bytes by stream",
                "bytes",
                [
                    q(sel("streams_retained_bytes"), "{{instance}} all streams"),
                    q(sel("stream_retained_bytes"), "{{instance}} {{stream}}"),
                ],
                "Backlog and retained acknowledged data: the total, and the streams with "
                "the largest backlog.",
            ),
            Panel(
                "Backlog by cursor",
                "none",
                [
                    q(sel("streams_backlog_entries"), "{{instance}} all cursors"),
                    q(sel("stream_backlog_entries"), "{{stream}}/{{cursor}}"),
                ],
                "Entries after each cursor's mark-delete position: the total, and the cursors "
                "of the streams with the largest backlog.",
            ),
            Panel(
                "Oldest unacknowledged",
                "s",
                [
                    q(
                        sel("streams_oldest_unacknowledged_age_seconds"),
                        "{{instance}} oldest of any cursor",
                    ),
                    q(sel("stream_oldest_unacknowledged_age_seconds"), "{{stream}}/{{cursor}}"),
                ],
                "A stuck consumer pins its stream's ledgers and their entry logs.",
            ),
        ],
    )
    offload = Row(
        "Offload (tiered storage)",
        [
            Panel(
                "Offload lag",
                "s",
                [q(sel("offload_lag_seconds"))],
                "Age of the oldest ledger due for offload and not offloaded.",
            ),
            Panel(
                "Offloaded ledgers and failures",
                "none",
                [
                    q(
                        "sum by (instance) "
                        f"(increase({sel('offload_completed_ledgers_total')}[1h]))",
                        "{{instance}} offloaded/h",
                    ),
                    q(
                        f"sum by (instance) (increase({sel('offload_upload_failures_total')}[1h]))",
                        "{{instance}} failures/h",
                    ),
                ],
                "In the last hour.",
            ),
            Panel(
                "Upload and fetch",
                "Bps",
                [
                    q(rate("offload_upload_bytes_total"), "{{instance}} uploaded"),
                    q(rate("offload_fetched_bytes_total"), "{{instance}} fetched"),
                ],
                "Bytes to and from the object store.",
            ),
            Panel(
                "Offloaded and awaiting deletion",
                "bytes",
                [
                    q(sel("offload_bytes"), "{{instance}} offloaded"),
                    q(sel("offload_awaiting_deletion_bytes"), "{{instance}} local, awaiting lag"),
                ],
                "Data objects in the store; local copies kept for the deletion lag.",
            ),
            Panel(
                "Object read latency",
                "s",
                [q(quantile(0.99, "offload_object_read_seconds"), "p99 {{instance}}")],
                "Reads from the object store.",
            ),
            Panel(
                "Unreadable objects",
                "none",
                [q(sel("offload_unreadable_objects_total"))],
                "Reads refused: an offloaded object missing or damaged (502).",
            ),
        ],
    )
    disks = Row(
        "Disks",
        [
            Panel(
                "Disk usage and watermarks",
                "percentunit",
                [
                    q(sel("disk_usage_ratio"), "{{instance}} {{dir}}"),
                    q(f"max by (instance) ({sel('disk_usage_warn_threshold_ratio')})", "warning"),
                    q(
                        f"max by (instance) ({sel('disk_usage_read_only_threshold_ratio')})",
                        "read-only",
                    ),
                ],
                "Per data dir.",
                max=1,
            ),
            Panel(
                "Read-only and warning",
                "none",
                [
                    q(sel("read_only"), "{{instance}} read-only"),
                    q(sel("disk_warning"), "{{instance}} disk warning"),
                ],
                "1 while adds are refused; 1 past the warning watermark.",
            ),
            Panel(
                "Emergency reserve",
                "bytes",
                [q(sel("disk_emergency_reserve_bytes"))],
                "0 once released on a full disk.",
            ),
        ],
    )
    audit = Row(
        "Audit",
        [
            Panel(
                "Audit violations by check",
                "none",
                [q(sel("audit_violations"), "{{instance}} {{check}}")],
                "Of the last audit posted to the node (POST /api/v1/audit/result).",
            ),
            Panel(
                "Time since the last audit",
                "s",
                [q(f"time() - {sel('audit_last_run_timestamp_seconds')}")],
                "The audit DAG runs daily.",
            ),
        ],
    )
    # Every node with a metadata store exports the fleet's figures (the store's audit report
    # and totals): max() over the chosen instances is the fleet's, whichever of them answer.
    replication = Row(
        "Replication",
        [
            Panel(
                "Under-replicated",
                "none",
                [
                    q(f"max({sel('under_replicated_ledgers')})", "ledgers"),
                    q(f"max({sel('under_replicated_fragments')})", "fragments"),
                ],
                "After the last autorecovery audit (fleet-wide); alert "
                "StorageNodeUnderReplicated past 30 minutes.",
                width=6,
                thresholds=RED_AT_1,
            ),
            Panel(
                "Nodes registered and lost",
                "none",
                [
                    q(f"sum({sel('registration_up')})", "registered (scraped)"),
                    q(f"max({sel('lost_nodes')})", "lost (past the delay)"),
                ],
                "Registered: nodes/<id> held under a lease. Lost: unregistered longer than "
                "the lost-node delay at the last audit.",
                width=6,
            ),
            Panel(
                "Re-replicated",
                "Bps",
                [q(f"max(rate({sel('rereplicated_bytes_total')}{RATE}))", "bytes copied")],
                "Payload bytes the autorecovery workers copied to replacement nodes.",
                width=6,
            ),
            Panel(
                "Time since the last autorecovery audit",
                "s",
                [q(f"time() - max({sel('autorecovery_last_run_timestamp_seconds')})", "audit")],
                "The storage_node_autorecovery DAG audits every 10 minutes.",
                width=6,
            ),
        ],
    )
    return Dashboard(
        "storage-node-lifecycle",
        "Storage node / Lifecycle",
        "GC and compaction, retention, offload, disks, the audit and replication: where the "
        "space goes, whether the data is what the node claims and has its copies.",
        [gc, retention, offload, disks, audit, replication],
    )


DASHBOARDS = (overview, internals, lifecycle)


# --- JSON ---------------------------------------------------------------------------------


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets: list[dict[str, Any]] = [
        {"datasource": DS, "expr": query.expr, "legendFormat": query.legend, "refId": chr(65 + i)}
        for i, query in enumerate(panel.queries)
    ]
    if panel.kind == "table":
        for target in targets:
            target |= {"format": "table", "instant": True}
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.thresholds:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [
                {"color": colour, "value": None if i == 0 else start}
                for i, (start, colour) in enumerate(panel.thresholds)
            ],
        }
    if panel.mappings:
        defaults["mappings"] = [
            {
                "type": "value",
                "options": {
                    v: {"text": text, "index": i}
                    for i, (v, text) in enumerate(panel.mappings.items())
                },
            }
        ]
    if panel.max is not None:
        defaults["min"], defaults["max"] = 0, panel.max
    return {
        "datasource": DS,
        "description": panel.description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "id": panel_id,
        "options": {},
        "targets": targets,
        "title": panel.title,
        "type": panel.kind,
    }


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        },
        {
            "name": "instance",
            "label": "Node",
            "type": "query",
            "datasource": DS,
            "query": {"query": "label_values(storage_node_state, instance)", "refId": "instance"},
            "definition": "label_values(storage_node_state, instance)",
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {},
            "refresh": 2,
            "sort": 1,
            "hide": 0,
        },
    ]


def build(dashboard: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y, panel_id = 0, 1
    for row in dashboard.rows:
        panels.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
                "id": panel_id,
                "panels": [],
                "title": row.title,
                "type": "row",
            }
        )
        panel_id, y, x, line_height = panel_id + 1, y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > WIDTH:  # wrap: Grafana would overlap otherwise
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id, x, line_height = panel_id + 1, x + panel.width, max(line_height, panel.height)
        y += line_height
    return {
        "annotations": {"list": []},
        "description": dashboard.description,
        "editable": True,
        "graphTooltip": 1,
        "links": [
            {
                "asDropdown": True,
                "tags": ["storage-node"],
                "title": "Dashboards",
                "type": "dashboards",
            },
        ],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": dashboard.tags,
        "templating": {"list": _variables()},
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "utc",
        "title": dashboard.title,
        "uid": dashboard.uid,
        "version": 1,
    }


def render(dashboard: Dashboard) -> str:
    return json.dumps(build(dashboard), indent=2, sort_keys=True) + "\n"


def prometheus_rule() -> str:
    """The rule file's groups as a PrometheusRule (prometheus-operator), so the cluster gets
    the very rules promtool tests."""
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "storage-node",
            "labels": {
                "app.kubernetes.io/name": "storage-node",
                "app.kubernetes.io/part-of": "storage-node",
            },
        },
        "spec": {"groups": groups},
    }
    header = (
        "# Generated from grafana/alerts/storage-node.rules.yml by `python -m grafana.generate`:\n"
        '# edit that file, not this one. Runbooks: docs/operations.md, "Alert runbooks".\n'
    )
    return header + str(yaml.safe_dump(rule, sort_keys=False, width=100))


def files() -> dict[Path, str]:
    """Each generated file and its text: the dashboards' JSON and the PrometheusRule."""
    out = {}
    for make in DASHBOARDS:
        dashboard = make()
        out[DASHBOARDS_DIR / f"{dashboard.uid.removeprefix('storage-node-')}.json"] = render(
            dashboard
        )
    out[PROMETHEUS_RULE] = prometheus_rule()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in files().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale, run python -m grafana.generate: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
