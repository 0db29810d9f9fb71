"""The client's metrics, in whatever process hosts the client (prometheus_client's default
registry: a node serving /metrics exports them with its own)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

ENSEMBLE_CHANGES = Counter(
    "storage_client_ensemble_changes_total",
    "Ensemble changes a writer made after a node failed (metadata CAS done)",
)
RECOVERIES = Counter(
    "storage_client_recoveries_total",
    "Ledger recoveries by outcome (closed, already_closed, failed)",
    ["outcome"],
)
ADDS_UNKNOWN = Counter(
    "storage_client_adds_unknown_total",
    "Adds whose outcome is unknown to the writer, by reason (fenced, closed, client_closed, ...)",
    ["reason"],
)
REPLICA_ADD_SECONDS = Histogram(
    "storage_client_replica_add_seconds",
    "Time from sending a replica add to a node to its answer",
    ["node"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
UNDER_REPLICATED_ADDS = Counter(
    "storage_client_under_replicated_adds_total",
    "Replica adds that failed after their entry was acknowledged (the ensemble changes anyway)",
)
RECOVERY_READDS_SHORT = Counter(
    "storage_client_recovery_readds_short_total",
    "Recovery re-adds that failed after their entry had Qa copies (the auditor repairs them)",
)
