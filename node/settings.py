"""The one settings object: every knob of the node, its default and its variable.

Names follow the keys of the systems operators already know (BookKeeper first, then
RocketMQ, AutoMQ and Pulsar) in snake case; the environment variable is ``NODE_`` plus the
name in upper case (``logSizeLimit`` -> ``log_size_limit`` -> ``NODE_LOG_SIZE_LIMIT``).
Sizes are bytes. A duration says its unit in its name: ``_ms`` or ``_s`` (the defaults of
stream policies keep Pulsar's ``_minutes`` and ``_in_seconds``, as the policies name them).
Settings renamed to say so are still read under their old names (RENAMED), with a warning.

Precedence: explicit arguments (the CLI's ``--data-dir`` ...) > environment > config file
(TOML or JSON, the same names) > defaults.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import tomllib
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
ENTRY_CACHE_MEMORY_SHARE = 0.10  # of physical memory, for stream_entry_cache_bytes' default
ENTRY_CACHE_MAX_DEFAULT = 256 * MiB


def _entry_cache_default() -> int:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(ENTRY_CACHE_MAX_DEFAULT, int(memory * ENTRY_CACHE_MEMORY_SHARE))


SECTOR = 512  # the smallest unit a disk writes atomically
WAL_BLOCK_ALIGNMENT = 4 * KiB  # raw-device WAL blocks start and end on these boundaries


# The unit of a number, for the message refusing one that is not ("10s"): its name's suffix.
UNIT_SUFFIXES = (
    ("_ms", "milliseconds"),
    ("_s", "seconds"),
    ("_seconds", "seconds"),
    ("_minutes", "minutes"),
    ("_mb", "MiB"),
    ("_mbytes", "MiB"),
    ("_bytes", "bytes"),
)
NUMBER_ERRORS = frozenset({"int_parsing", "float_parsing", "int_from_float", "int_type"})

# Old name -> new name: the unit joined the names of these (and a typo went), but
# configurations and NODE_* variables written for the old names (BookKeeper's, RocketMQ's)
# still work; each old name in use is logged once at start (Settings.deprecations). The
# value is the same number in the same unit. An old name counts as its new one in the same
# place (the environment's beats the config file's); both names in one place are refused.
RENAMED = {
    "journal_max_group_wait_msec": "journal_max_group_wait_ms",
    "flush_interval": "flush_interval_ms",
    "gc_wait_time": "gc_wait_time_ms",
    "minor_compaction_interval": "minor_compaction_interval_s",
    "major_compaction_interval": "major_compaction_interval_s",
    "major_compaction_max_time_millis": "major_compaction_max_time_ms",
    "minor_compaction_max_time_millis": "minor_compaction_max_time_ms",
    "destroy_maped_file_interval_forcibly": "destroy_mapped_file_interval_forcibly_ms",
    "disk_check_interval": "disk_check_interval_ms",
    "delete_commit_log_files_interval": "delete_commit_log_files_interval_ms",
}

ENV_PREFIX = "NODE_"
# Variables of Node.js (nodejs.org/api/cli.html) share the prefix; a tool started from npm or
# an editor carries them (NODE_EXTRA_CA_CERTS, NODE_OPTIONS), so they are not typos of ours.
FOREIGN_ENV = frozenset(
    {
        "NODE_CHANNEL_FD",
        "NODE_CHANNEL_SERIALIZATION_MODE",
        "NODE_CLUSTER_SCHED_POLICY",
        "NODE_COMPILE_CACHE",
        "NODE_DEBUG",
        "NODE_DEBUG_NATIVE",
        "NODE_DISABLE_COLORS",
        "NODE_DISABLE_COMPILE_CACHE",
        "NODE_ENV",
        "NODE_EXTRA_CA_CERTS",
        "NODE_ICU_DATA",
        "NODE_NO_WARNINGS",
        "NODE_OPTIONS",
        "NODE_PATH",
        "NODE_PENDING_DEPRECATION",
        "NODE_PENDING_PIPE_INSTANCES",
        "NODE_PRESERVE_SYMLINKS",
        "NODE_REDIRECT_WARNINGS",
        "NODE_REPL_EXTERNAL_MODULE",
        "NODE_REPL_HISTORY",
        "NODE_SKIP_PLATFORM_CHECK",
        "NODE_TEST_CONTEXT",
        "NODE_TLS_REJECT_UNAUTHORIZED",
        "NODE_UNIQUE_ID",
        "NODE_USE_ENV_PROXY",
        "NODE_V8_COVERAGE",
    }
)


def _origin(value: str) -> str:
    """An origin as browsers send it: scheme://host[:port], no path, lower case."""
    origin = value.lower().rstrip("/")
    scheme, sep, host = origin.partition("://")
    if origin != "*" and (scheme not in ("http", "https") or not sep or not host or "/" in host):
        raise ValueError(f"an origin is http(s)://host[:port] or *, not {value!r}")
    return origin


def _fault(value: str) -> str:
    """A fault entry the node understands (node.faultpoints), or refuse to start."""
    from node.faultpoints import parse

    parse(value)
    return value


# The sources load() adds below the environment, for the Settings it builds (a subclass per
# load, as before, rebuilt the whole model's schema: a tenth of a second of every start).
_LOWER_SOURCES: ContextVar[tuple[dict[str, Any], ...]] = ContextVar("lower_sources", default=())


class SettingsError(ValueError):
    """Settings that the node refuses to start with; the message names the setting."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # --- node and HTTP -------------------------------------------------------------------
    data_dir: Path = Path("./data")  # journal/, ledgers/ (entry logs), index/ (RocksDB)
    http_host: str = "127.0.0.1"  # listen address; loopback unless you mean it
    http_port: int = Field(8080, ge=0, le=65535)  # BookKeeper httpServerPort
    max_entry_size: int = Field(5 * MiB, gt=0)  # largest payload (BookKeeper nettyMaxFrameSize)
    max_request_size: int = Field(64 * MiB, gt=0)  # largest HTTP body (a batch of entries)
    max_entries_per_batch: int = Field(10_000, gt=0)  # entries in one batch request
    # Adds with bodies up to this are answered from the socket, past aiohttp's web stack
    # (node/http/fastlane.py); larger ones, and every other request, go through aiohttp. 0: off.
    http_fast_lane_max_body: int = Field(4 * MiB, ge=0)
    # Request bodies held at once, node-wide: what bounds their memory (not connections).
    max_request_bytes_in_flight: int = Field(128 * MiB, gt=0)
    request_budget_wait_s: float = Field(1.0, ge=0)  # a body or read waits this for room, then 503
    body_read_timeout_s: float = Field(30.0, gt=0)  # longest silence within a request body
    header_timeout_s: float = Field(10.0, gt=0)  # a request head must arrive within this
    keepalive_timeout_s: float = Field(75.0, gt=0)  # an idle connection is closed after this
    range_read_chunk_entries: int = Field(256, gt=0)  # a range read yields the loop this often
    # Frame bytes in one read reply (stream, cursor, ledger range): a reply stops before
    # passing it and says where to go on; an entry larger than it goes alone.
    max_read_reply_bytes: int = Field(16 * MiB, gt=0)
    # Read replies held at once, node-wide: what bounds their memory (not connections).
    max_read_bytes_in_flight: int = Field(128 * MiB, gt=0)
    reply_write_timeout_s: float = Field(30.0, gt=0)  # a reply the client stops taking: closed
    max_long_poll_ms: int = Field(60_000, gt=0)  # longest wait a long poll may ask for
    # Open HTTP connections (long polls included); more get 503 too_many_connections at once.
    max_connections: int = Field(512, gt=0)
    node_id: int = Field(0, ge=0)  # this node's id, written into the WAL header
    admin_token: SecretStr | None = None  # bearer token for PUT/POST/DELETE under /api/v1/
    # Host names a client may use besides the node's own (docs/api.md, "Cross-site requests"):
    # "name", ".domain" (it and its subdomains), "*" (any: DNS rebinding is let through).
    allowed_hosts: list[str] = []
    # Origins ("https://ui.example:8443") whose pages may change state (CORS); "*" any.
    allowed_origins: list[Annotated[str, AfterValidator(_origin)]] = []
    shutdown_timeout_s: float = Field(30.0, gt=0)  # how long SIGTERM waits for requests
    log_level: str = "info"  # debug, info, warning, error
    log_json: bool = False  # one JSON object per log line (with request ids)
    status_history_interval_s: float = Field(5.0, gt=0)  # the status page's history: sample period
    status_history_window_s: float = Field(900.0, gt=0)  # ... and how far back it keeps samples
    # the status page's fleet view reads every ledger in the metadata store: reused this long
    status_fleet_cache_s: float = Field(5.0, gt=0)
    metrics_max_streams: int = Field(100, ge=0)  # streams with own series, largest backlog first

    # --- write-ahead log -----------------------------------------------------------------
    wal_kind: Literal["journal", "blockdev"] = "journal"  # file journal or raw-device ring
    wal_path: Path | None = None  # the raw-device WAL's device or file (blockdev only)
    wal_capacity: int = Field(2 * GiB, gt=0)  # raw-device ring capacity, fixed at creation
    # Raw-device ring (AutoMQ); appends wait for room up to db_storage_max_throttle_time_ms.
    wal_block_soft_limit: int = Field(256 * KiB, gt=0)  # AutoMQ blockSoftLimit: a block closes here
    wal_write_rate_limit: int = Field(3000, ge=0)  # AutoMQ writeRateLimit: blocks/s (gp3), 0 = none
    wal_io_depth: int = Field(4, gt=0)  # blocks written at once (AutoMQ iodepth; 8 there)
    wal_volatile_write_cache: bool = True  # flush before acks; false only if none (EBS)
    wal_sync_mode: Literal["fdatasync", "dsync"] = "fdatasync"  # a flush thread, or O_DSYNC writes

    # --- replication (on when metadata_url is set; docs/replication.md) -----------------
    metadata_url: str = ""  # etcd://host:port[,host:port...]/prefix; empty: every ledger local
    id: str = Field(default_factory=socket.gethostname)  # fleet id: pod name; default host
    advertised_url: str = ""  # URL peers and clients reach this node at; "": http://host:port
    zone: str = ""  # failure domain for placement (the k8s node's topology.kubernetes.io/zone)
    zone_file: Path | None = None  # zone read from this file when zone is "" (k8s init container)
    registration_ttl_s: int = Field(10, gt=0)  # lease of nodes/<id>: a dead node vanishes after it
    stream_owner_ttl_s: int = Field(10, gt=0)  # owner lease: a dead node's streams move after it
    # a non-owner forwards to the owner it read this long ago without reading it again (after
    # a takeover, a request sent to the old owner in that window is answered 503 not_owner)
    stream_owner_cache_ms: int = Field(1000, ge=0)
    # entries the owner of replicated streams keeps after their append, for tailing readers
    # (Pulsar's managedLedgerCacheSizeMB); 0: none. Default: 10 % of memory, at most 256 MiB
    stream_entry_cache_bytes: int = Field(default_factory=lambda: _entry_cache_default(), ge=0)
    metadata_timeout_s: float = Field(5.0, gt=0)  # longest wait for one metadata store request
    replication_gc_interval_s: int = Field(600, gt=0)  # sweep for replicas of deleted ledgers
    replication_gc_grace_s: int = Field(600, ge=0)  # the sweep never reclaims a younger replica
    # a replica no segment names (an interrupted re-replication's copy) is deleted only after
    # this long without a replica add (BookKeeper's gcOverreplicatedLedgerWaitTime: one day)
    replication_overreplicated_grace_s: int = Field(86_400, ge=0)
    lost_node_recovery_delay_s: float = Field(600, ge=0)  # unregistered this long: a lost node
    open_ledger_rereplication_grace_s: float = Field(30, ge=0)  # an open ledger's writer's time
    autorecovery_lock_ttl_s: int = Field(30, gt=0)  # lease of a marker's lock (worker dies: freed)
    autorecovery_poll_s: float = Field(30.0, gt=0)  # re-read the auditor's report and totals
    # a stream request forwarded to its owner: its longest silence, beyond a long poll's waitMs
    stream_forward_timeout_s: float = Field(30.0, gt=0)
    stream_forward_connect_timeout_s: float = Field(5.0, gt=0)  # connecting to a stream's owner

    # --- journal (BookKeeper) ------------------------------------------------------------
    # group commit: max age of a group; eager (below): the longest wait for more records
    # to join the ones that came after a small write
    journal_max_group_wait_ms: float = Field(2.0, ge=0)
    journal_buffered_writes_threshold: int = Field(512 * KiB, gt=0)  # group commit: max bytes
    journal_flush_when_queue_empty: bool = True  # write whenever the writer is idle (no group wait)
    journal_alignment_size: int = Field(512, gt=0)  # group writes are padded to this boundary
    journal_pre_alloc_size: int = Field(16 * MiB, gt=0)  # preallocation step of journal files
    journal_max_size: int = Field(2 * GiB, gt=0)  # rotate a journal file past this size
    journal_max_backups: int = Field(5, ge=0)  # journals before the mark kept for forensics
    journal_sync_data: bool = True  # fdatasync each group (never turn off outside benchmarks)
    skip_replay_journal_invalid_record: bool = False  # replay past corrupt records (data loss)

    # --- entry logs and caches (BookKeeper DbLedgerStorage) -------------------------------
    log_size_limit: int = Field(1 * GiB, gt=0)  # roll an entry log past this size
    flush_interval_ms: int = Field(10_000, gt=0)  # checkpoint period
    db_storage_write_cache_max_size: int = Field(64 * MiB, gt=0)  # both halves of the cache
    db_storage_read_ahead_cache_max_size: int = Field(64 * MiB, gt=0)  # read cache bytes
    db_storage_read_cache_segments: int = Field(8, ge=2)  # ring segments of the read cache
    db_storage_read_ahead_cache_batch_size: int = Field(1000, ge=0)  # read-ahead max entries
    db_storage_read_ahead_cache_batch_bytes_size: int = Field(4 * MiB, gt=0)  # read-ahead bytes
    db_storage_max_throttle_time_ms: int = Field(10_000, ge=0)  # add wait on a full cache
    open_file_limit: int = Field(256, gt=0)  # entry log read handles kept open

    # --- garbage collection and compaction (BookKeeper) -----------------------------------
    gc_wait_time_ms: int = Field(600_000, gt=0)  # GC period
    minor_compaction_threshold: float = Field(0.2, ge=0)  # minor compacts logs below this usage
    minor_compaction_interval_s: int = Field(3600, ge=0)  # between minor compactions
    major_compaction_threshold: float = Field(0.8, ge=0)  # major compacts logs below this usage
    major_compaction_interval_s: int = Field(86_400, ge=0)  # between major compactions
    # sealed logs above this x their live bytes: compact the emptiest at once; 0 = off
    compaction_space_amplification_limit: float = Field(1.25, ge=0)
    major_compaction_max_time_ms: int = Field(-1, ge=-1)  # bound of one run; -1 = none
    minor_compaction_max_time_ms: int = Field(-1, ge=-1)  # bound of one run; -1 = none
    compaction_rate_by_entries: int = Field(1000, gt=0)  # throttle, entries/s
    compaction_rate_by_bytes: int = Field(1_000_000, gt=0)  # throttle, bytes/s (read + written)
    is_throttle_by_bytes: bool = False  # throttle by bytes instead of entries
    # GC's reads, bytes/s: logs a crash left without a ledgers map; compaction by entries
    gc_read_rate_by_bytes: int = Field(32 * MiB, gt=0)
    # RocketMQ: a retired log still held by a read is deleted anyway this long after
    destroy_mapped_file_interval_forcibly_ms: int = Field(120_000, ge=0)

    # --- disks (BookKeeper LedgerDirsMonitor, RocketMQ) ------------------------------------
    disk_check_interval_ms: int = Field(10_000, gt=0)  # between disk usage checks
    gc_disk_usage_threshold: float = Field(0.85, ge=0)  # above: GC runs at once
    disk_usage_warn_threshold: float = Field(0.90, ge=0)  # above: warning and metric
    disk_usage_threshold: float = Field(0.95, ge=0)  # above: read-only
    disk_usage_lwm_threshold: float = Field(0.90, ge=0)  # below: writable again
    # deleted when the disk is full, so that the index and GC can work; 0 = none
    disk_emergency_reserve_bytes: int = Field(64 * MiB, ge=0)
    disk_max_used_space_ratio: float = Field(0.75, ge=0)  # RocketMQ: retention cleans above
    disk_space_clean_forcibly_ratio: float = Field(0.85, ge=0)  # RocketMQ: forced cleaning

    # --- streams and retention (Pulsar, RocketMQ) ------------------------------------------
    # a replicated stream's ledgers (with a metadata store; a PUT's "replication" overrides)
    stream_ensemble_size: int = Field(3, ge=1)  # E: nodes a ledger's entries are striped over
    stream_write_quorum: int = Field(3, ge=1)  # Qw: copies of each entry
    stream_ack_quorum: int = Field(2, ge=1)  # Qa: durable copies before an append is acknowledged
    managed_ledger_min_ledger_rollover_time_minutes: int = Field(10, ge=0)  # never roll sooner
    managed_ledger_max_ledger_rollover_time_minutes: int = Field(240, ge=0)  # roll when older
    managed_ledger_max_entries_per_ledger: int = Field(50_000, gt=0)  # roll at this many entries
    managed_ledger_max_size_per_ledger_mbytes: int = Field(2048, gt=0)  # roll at this size
    default_retention_time_in_minutes: int = Field(72 * 60, ge=-1)  # RocketMQ fileReservedTime
    default_retention_size_in_mb: int = Field(-1, ge=-1)  # -1 = unlimited
    delete_when: str = "04"  # RocketMQ: hour(s) of the day retention runs, "04;16"
    retention_scheduler_enabled: bool = True  # run retention at delete_when (off with Airflow)
    delete_commit_log_files_interval_ms: int = Field(100, ge=0)  # RocketMQ: between deletions
    # new streams' "deduplication" policy: appends with producer ids land once (Pulsar's
    # brokerDeduplicationEnabled)
    stream_deduplication_enabled: bool = False
    # producers a deduplicating stream tracks; a new one past it is refused (429)
    stream_dedup_max_producers: int = Field(10_000, gt=0)
    # a producer silent this long is forgotten (Pulsar's ...ProducerInactivityTimeoutMinutes)
    stream_dedup_producer_inactivity_minutes: int = Field(360, gt=0)
    # entries between two snapshots of a stream's producer table: at most this many are read
    # again to rebuild it (Pulsar's brokerDeduplicationEntriesInterval is 1,000 of its
    # entries, each a batch; here a batch's messages are entries: 1,000 made 100-entry batches
    # write one per 10 appends, a fifth more CPU)
    stream_dedup_snapshot_interval_entries: int = Field(10_000, gt=0)

    # --- audit (docs/operations.md "Audit") ----------------------------------------------
    # Where POST /api/v1/audit/snapshot writes; None = data_dir/audit/snapshots. A file:// target
    # of that request must lie under it: the HTTP API never writes anywhere else on the host.
    audit_snapshot_dir: Path | None = None
    # Snapshots kept there (each holds its logs: GC cannot free them); a new one deletes older
    audit_snapshots_kept: int = Field(3, ge=1)
    # Snapshot bytes served to the audit's executors per second, node-wide; 0: no cap
    audit_serve_bytes_per_s: int = Field(32 * MiB, ge=0)
    audit_result_max_bytes: int = Field(1 * MiB, gt=0)  # largest POST /api/v1/audit/result body
    # a posted result finished further ahead of the node's clock is refused (a stale-audit
    # alert would stay quiet until then)
    audit_result_clock_skew_ms: int = Field(5 * 60_000, ge=0)

    # --- offload (Pulsar tiered storage, docs/operations.md "Offload") ---------------
    offload_store: Literal["local", "s3"] = "local"  # a local directory, or any S3 service
    offload_local_dir: Path | None = None  # the local store's directory; None = data_dir/offload
    offload_bucket: str = ""  # S3 bucket (offload_store=s3)
    offload_prefix: str = ""  # key prefix in the bucket (or under the local directory)
    offload_endpoint: str = ""  # S3 endpoint URL; "" = AWS itself (http:// allowed: MinIO, moto)
    offload_region: str = ""  # S3 region; "" = AWS_REGION / AWS_DEFAULT_REGION
    offload_access_key_id: str = ""  # "" = AWS_ACCESS_KEY_ID (the standard variables)
    offload_secret_access_key: SecretStr | None = None  # None = AWS_SECRET_ACCESS_KEY
    offload_virtual_hosted_style: bool = False  # bucket in the host name; path style otherwise
    offload_max_retries: int = Field(3, ge=0)  # retries of one object request before it fails
    offload_request_timeout_s: float = Field(30.0, gt=0)  # one object request (Pulsar: 25 s)
    offload_operation_timeout_s: float = Field(10.0, gt=0)  # one store call, retries included
    managed_ledger_offload_threshold_in_bytes: int = Field(-1, ge=-1)  # keep newest N local
    managed_ledger_offload_threshold_in_seconds: int = Field(-1, ge=-1)  # offload older; -1 off
    managed_ledger_offload_deletion_lag_ms: int = Field(4 * 3600 * 1000, ge=0)  # then local goes
    managed_ledger_offload_max_block_size_in_bytes: int = Field(64 * MiB, gt=0)  # data blocks
    # index stride: an index point at least this often, so a random read fetches at most this
    managed_ledger_offload_read_buffer_size_in_bytes: int = Field(1 * MiB, gt=0)
    managed_ledger_offload_prefetch_rounds: int = Field(1, ge=0)  # ranges read ahead in order
    # where reads of an offloaded ledger go while the local copy still exists (Pulsar's key)
    managed_ledger_data_read_priority: Literal["tiered-storage-first", "bookkeeper-first"] = (
        "tiered-storage-first"
    )
    offload_block_cache_size: int = Field(64 * MiB, ge=0)  # bytes of fetched ranges kept
    offload_index_cache_ledgers: int = Field(1024, gt=0)  # index objects kept in memory
    offload_scheduler_enabled: bool = False  # offload by itself (off: Airflow calls the route)
    offload_scheduler_interval_s: int = Field(600, gt=0)  # period of the in-node scheduler

    # --- tests only ---------------------------------------------------------------------
    crash_points: frozenset[str] = frozenset()  # named points where the node SIGKILLs itself
    # Injected faults at named points, each `<point>=eio|short|short:crash|delay:S|crash`
    # with optional `,after=N` and `,times=N` (docs/internals.md, "Fault injection").
    faults: list[Annotated[str, AfterValidator(_fault)]] = []

    # Not a setting: what load() found under old names (RENAMED), for serve to log once
    # logging is set up (the settings say how to log).
    _deprecations: tuple[str, ...] = PrivateAttr(default=())

    @property
    def deprecations(self) -> tuple[str, ...]:
        """A warning for each old setting name (RENAMED) that load() was given."""
        return self._deprecations

    @model_validator(mode="after")
    def _zone_from_file(self) -> Settings:
        """On Kubernetes the zone is a label of the node the pod runs on, which the downward
        API cannot give: an init container writes it to a file (python -m node zone)."""
        if self.zone_file is not None and not self.zone:
            try:
                self.zone = self.zone_file.read_text().strip()
            except OSError as error:
                raise ValueError(f"zone_file {self.zone_file}: {error.strerror}") from None
        return self

    @model_validator(mode="after")
    def _check_relations(self) -> Settings:
        for name in (
            "minor_compaction_threshold",
            "major_compaction_threshold",
            "gc_disk_usage_threshold",
            "disk_usage_warn_threshold",
            "disk_usage_threshold",
            "disk_usage_lwm_threshold",
            "disk_max_used_space_ratio",
            "disk_space_clean_forcibly_ratio",
        ):
            if getattr(self, name) > 1.0:
                raise ValueError(f"{name} must be at most 1.0, got {getattr(self, name)}")
        if self.minor_compaction_threshold > self.major_compaction_threshold:
            raise ValueError(
                "minor_compaction_threshold must not exceed major_compaction_threshold "
                f"({self.minor_compaction_threshold} > {self.major_compaction_threshold})"
            )
        if (
            self.minor_compaction_interval_s > 0
            and self.major_compaction_interval_s > 0
            and self.minor_compaction_interval_s >= self.major_compaction_interval_s
        ):
            raise ValueError(
                "minor_compaction_interval_s must be below major_compaction_interval_s "
                f"({self.minor_compaction_interval_s} >= {self.major_compaction_interval_s})"
            )
        if 0 < self.compaction_space_amplification_limit <= 1:
            raise ValueError(
                "compaction_space_amplification_limit must be 0 (off) or above 1 "
                f"(got {self.compaction_space_amplification_limit})"
            )
        if not (self.stream_ensemble_size >= self.stream_write_quorum >= self.stream_ack_quorum):
            raise ValueError(
                "stream_ensemble_size >= stream_write_quorum >= stream_ack_quorum, got "
                f"{self.stream_ensemble_size}/{self.stream_write_quorum}/{self.stream_ack_quorum}"
            )
        if self.disk_usage_lwm_threshold > self.disk_usage_threshold:
            raise ValueError("disk_usage_lwm_threshold must not exceed disk_usage_threshold")
        if self.disk_usage_warn_threshold > self.disk_usage_threshold:
            raise ValueError("disk_usage_warn_threshold must not exceed disk_usage_threshold")
        alignment = self.journal_alignment_size
        if alignment < SECTOR or alignment & (alignment - 1):
            raise ValueError(f"journal_alignment_size must be a power of two >= {SECTOR}")
        if self.journal_pre_alloc_size % self.journal_alignment_size:
            raise ValueError("journal_pre_alloc_size must be a multiple of journal_alignment_size")
        if self.max_request_bytes_in_flight < self.max_request_size:
            raise ValueError(
                "max_request_bytes_in_flight must be at least max_request_size "
                "(else a body of the largest size could never be read)"
            )
        if self.max_read_bytes_in_flight < self.max_read_reply_bytes + self.max_entry_size:
            raise ValueError(
                "max_read_bytes_in_flight must be at least max_read_reply_bytes + "
                "max_entry_size (else a reply of the largest size could never be gathered)"
            )
        if self.max_entry_size > self.log_size_limit // 2:
            raise ValueError("max_entry_size must be at most half of log_size_limit")
        if self.max_entry_size > self.db_storage_write_cache_max_size // 2:
            raise ValueError("max_entry_size must fit in half of db_storage_write_cache_max_size")
        if self.log_size_limit > 0xFFFF_FFFF:
            raise ValueError("log_size_limit must fit an entry location's 32-bit offset")
        if self.wal_kind == "blockdev" and self.wal_path is None:
            raise ValueError("wal_path must name a block device or file when wal_kind=blockdev")
        if self.wal_kind == "journal" and self.wal_path is not None:
            # Ignored, it would hide a forgotten wal_kind=blockdev: a WAL in the wrong place.
            raise ValueError(
                f"wal_path ({self.wal_path}) is the raw-device WAL's: set wal_kind=blockdev, or "
                "unset it (the file journal is always data_dir/journal)"
            )
        if self.offload_store == "s3" and not self.offload_bucket:
            raise ValueError("offload_bucket must name a bucket when offload_store=s3")
        if self.wal_capacity % WAL_BLOCK_ALIGNMENT:
            raise ValueError(f"wal_capacity must be a multiple of {WAL_BLOCK_ALIGNMENT}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Below the environment, what load() gives for this construction: the old variable
        # names' values, then the config file's.
        lower = (_DictSource(settings_cls, values) for values in _LOWER_SOURCES.get())
        return (init_settings, env_settings, *lower)

    @property
    def journal_dir(self) -> Path:
        return self.data_dir / "journal"

    @property
    def ledgers_dir(self) -> Path:
        return self.data_dir / "ledgers"

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    @property
    def audit_snapshots_dir(self) -> Path:
        return self.audit_snapshot_dir or self.data_dir / "audit" / "snapshots"

    @property
    def offload_dir(self) -> Path:
        return self.offload_local_dir or self.data_dir / "offload"


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise SettingsError(f"config file {path} is not valid TOML/JSON: {e}") from e
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a table of settings")
    return data


def load(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings: overrides > NODE_* environment > config file > defaults.

    Raises SettingsError with a message that names each offending setting.
    """
    notes: list[str] = []
    given_as: dict[str, str] = {}  # new name -> the old name it was set by
    file_values = _read_config_file(config_file) if config_file else {}
    file_values = _renamed(file_values, str, f"in config file {config_file}", notes, given_as)
    explicit = {k: v for k, v in overrides.items() if v is not None}  # code: new names only
    _refuse_unknown(file_values, f"in config file {config_file}")
    _refuse_unknown(explicit, "given")
    _refuse_unknown_env(os.environ)
    env = _env_by_name(os.environ)
    # What old variables set (pydantic-settings reads the others, under the new names).
    old_env = {
        name: value
        for name, value in _renamed(env, _variable, "", notes, given_as).items()
        if name not in env
    }
    for name in [*explicit, *env]:  # set under its new name where that wins: not "given as"
        given_as.pop(name, None)

    lower = _LOWER_SOURCES.set((old_env, file_values))
    try:
        # Its model_fields_set says which settings were given, not defaulted:
        # sizing.fit_to_disks fits only the defaults to the disks.
        settings = Settings(**explicit)
    except ValidationError as e:
        raise SettingsError(_describe(e, given_as)) from None
    finally:
        _LOWER_SOURCES.reset(lower)
    settings._deprecations = tuple(notes)
    return settings


def _variable(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def _env_by_name(environ: Mapping[str, str]) -> dict[str, str]:
    """The NODE_* variables by setting name (read case-insensitively, as pydantic-settings
    reads them)."""
    return {
        variable.upper().removeprefix(ENV_PREFIX).lower(): value
        for variable, value in environ.items()
        if variable.upper().startswith(ENV_PREFIX)
    }


def _renamed(
    values: Mapping[str, Any],
    label: Callable[[str], str],
    where: str,
    notes: list[str],
    given_as: dict[str, str],
) -> dict[str, Any]:
    """``values`` with each old name (RENAMED) replaced by its new one; a note for each,
    naming both as ``label`` writes them; both names set is refused."""
    renamed = {name: value for name, value in values.items() if name not in RENAMED}
    place = f" {where}" if where else ""
    for old, new in RENAMED.items():
        if old not in values:
            continue
        if new in values:
            raise SettingsError(
                f"{label(old)} and {label(new)} are both set{place}: {label(old)} is the old "
                f"name of {label(new)}; keep only {label(new)}"
            )
        renamed[new] = values[old]
        given_as[new] = label(old)
        notes.append(
            f"{label(old)}{place} is deprecated: it is now {label(new)} (the same value, "
            "in the same unit); rename it"
        )
    return renamed


def _closest(name: str) -> str:
    close = difflib.get_close_matches(name.lower(), Settings.model_fields, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _refuse_unknown(names: Iterable[str], where: str) -> None:
    """A misspelled setting is refused rather than silently left at its default."""
    for name in names:
        if name not in Settings.model_fields:
            raise SettingsError(f"unknown setting {name!r} {where}{_closest(name)}")


def _refuse_unknown_env(environ: Mapping[str, str]) -> None:
    """The environment is read case-insensitively, as pydantic-settings reads it."""
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith(ENV_PREFIX) or upper in FOREIGN_ENV:
            continue
        name = upper.removeprefix(ENV_PREFIX).lower()
        if name not in Settings.model_fields and name not in RENAMED:
            close = difflib.get_close_matches(name, Settings.model_fields, n=1)
            hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
            raise SettingsError(f"unknown setting in the environment: {variable}{hint}")


class _DictSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def _unit(name: str) -> str | None:
    return next((unit for suffix, unit in UNIT_SUFFIXES if name.endswith(suffix)), None)


def _describe(error: ValidationError, given_as: Mapping[str, str]) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["loc"]:  # a single field; a rule between fields names them in its message
            name = ".".join(str(p) for p in item["loc"])
            if item["type"] in NUMBER_ERRORS:
                unit = _unit(name)
                number = "an integer" if item["type"].startswith("int") else "a number"
                message = (
                    f"{item['input']!r} is not {number}: the unit is {unit}, written as "
                    f"{number} alone, with no unit suffix"
                    if unit
                    else f"{item['input']!r} is not {number} ({message})"
                )
            as_old = f", given as {given_as[name]}" if name in given_as else ""
            message = f"invalid setting {name} ({_variable(name)}{as_old}): {message}"
        else:
            message = f"invalid settings: {message}"
        lines.append(message)
    return "; ".join(lines)


def data_dirs(settings: Settings) -> dict[str, Path]:
    """The node's data directories by kind (disk metrics, status, offload's disk check)."""
    return {
        "journal": settings.journal_dir,
        "ledgers": settings.ledgers_dir,
        "index": settings.index_dir,
    }
