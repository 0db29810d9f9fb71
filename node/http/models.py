"""The JSON bodies of the HTTP API, described once.

Handlers validate request bodies with these types and build their JSON replies from the
response models; /openapi.json takes its component schemas from the same types
(``json_schema``), so the document and the node cannot disagree about what a body may hold.
What a schema cannot say (a position must be in the stream, a minimum rollover time must
not exceed the maximum) is refused with 422, which the document declares; 400 means the
request breaks a schema of the document.
"""

# No `from __future__ import annotations` here: pydantic would evaluate each of the ~400
# annotations from a string (a compile per annotation), a quarter of this module's import.
import json
import reprlib
from typing import Annotated, Any, Generic, Literal, NotRequired, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    with_config,
)

# pydantic needs typing_extensions.TypedDict below Python 3.12
from typing_extensions import TypedDict

from node.audit import CHECKS
from node.http.errors import ApiError
from node.status.entrylogs import PinReason
from node.storage.index import MAX_ID, STREAM_PROPERTY, LedgerState, OffloadState
from node.streams.model import ID_DIGITS, NAME, POSITION
from node.streams.policies import POLICIES

REF_TEMPLATE = "#/components/schemas/{model}"
POSITION_PATTERN = f"^{POSITION.pattern}$"
CURSOR_START_PATTERN = f"^(earliest|latest|{POSITION.pattern})$"
NAME_PATTERN = f"^{NAME.pattern}$"
ID_PATTERN = f"^{ID_DIGITS}$"
MESSAGE_LIMIT = 300  # characters of a validation error echoed back
REQUEST = ConfigDict(extra="forbid", strict=True)

Position = Annotated[
    str, Field(pattern=POSITION_PATTERN, description="L:E (ledger id:entry id), decimal")
]
Id = Annotated[int, Field(ge=0, le=MAX_ID)]
MarkDelete = Annotated[
    Position | None,
    Field(
        description="The last entry the cursor acknowledged (L:-1: none of ledger L, the "
        "stream's first); null while the stream holds no ledger yet (nothing to acknowledge)"
    ),
]
Count = Annotated[int, Field(ge=0)]
Millis = Annotated[int, Field(description="ms since the epoch")]


def _integral(value: Any) -> Any:
    """JSON Schema's integer is a number with no fractional part, so 5.0 is one: take it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _policy(name: str) -> Any:
    rule = POLICIES[name]
    return Field(ge=rule.low, le=rule.high, description=rule.description)


# After the bounds in an Annotated: placed before them, it would hide them from the schema.
INTEGRAL = BeforeValidator(_integral)


# --- request bodies ----------------------------------------------------------------------


@with_config(REQUEST)
class CreateLedger(TypedDict, total=False):
    properties: Annotated[
        dict[str, str],
        Field(
            description=f"Free-form; {STREAM_PROPERTY!r} is reserved for ledgers of streams",
            json_schema_extra={"propertyNames": {"not": {"const": STREAM_PROPERTY}}},
        ),
    ]
    writeToken: Annotated[str, Field(min_length=1, description="Required with every change")]


Quorum = Annotated[int, Field(ge=1, le=32), INTEGRAL]


@with_config(REQUEST)
class StreamReplication(TypedDict):
    """BookKeeper's E, Qw, Qa of the stream's ledgers (E >= Qw >= Qa >= 1); only with a
    metadata store: a node without one keeps every ledger on its own volume (1/1/1)."""

    ensemble: Quorum
    writeQuorum: Quorum
    ackQuorum: Quorum


@with_config(REQUEST)
class StreamPolicies(TypedDict, total=False):
    """Pulsar's names (``node.streams.policies``, which gives their bounds and descriptions);
    an absent key takes the node's default (its setting)."""

    minLedgerRolloverTimeMinutes: Annotated[int, _policy("minLedgerRolloverTimeMinutes"), INTEGRAL]
    maxLedgerRolloverTimeMinutes: Annotated[int, _policy("maxLedgerRolloverTimeMinutes"), INTEGRAL]
    maxEntriesPerLedger: Annotated[int, _policy("maxEntriesPerLedger"), INTEGRAL]
    maxSizePerLedgerMbytes: Annotated[int, _policy("maxSizePerLedgerMbytes"), INTEGRAL]
    retentionTimeInMinutes: Annotated[int, _policy("retentionTimeInMinutes"), INTEGRAL]
    retentionSizeInMB: Annotated[int, _policy("retentionSizeInMB"), INTEGRAL]
    messageTtlInSeconds: Annotated[int, _policy("messageTtlInSeconds"), INTEGRAL]
    offloadThresholdInBytes: Annotated[int, _policy("offloadThresholdInBytes"), INTEGRAL]
    offloadThresholdInSeconds: Annotated[int, _policy("offloadThresholdInSeconds"), INTEGRAL]
    offloadDeletionLagInMillis: Annotated[int, _policy("offloadDeletionLagInMillis"), INTEGRAL]
    deduplication: Annotated[bool, Field(description=POLICIES["deduplication"].description)]
    replication: StreamReplication


@with_config(REQUEST)
class CreateCursor(TypedDict, total=False):
    start: Annotated[
        str,
        Field(
            pattern=CURSOR_START_PATTERN,
            description='"earliest", "latest" (the default) or L:E, the next entry it reads',
        ),
    ]


@with_config(REQUEST)
class PositionBody(TypedDict):
    position: Position


@with_config(REQUEST)
class ReadOnlyBody(TypedDict):
    readOnly: bool


@with_config(REQUEST)
class GcRequest(TypedDict, total=False):
    forceMajor: bool
    forceMinor: bool


@with_config({**REQUEST, "json_schema_extra": {"minProperties": 1}})
class SuspendCompaction(TypedDict, total=False):
    suspendMajor: bool
    suspendMinor: bool


@with_config({**REQUEST, "json_schema_extra": {"minProperties": 1}})
class ResumeCompaction(TypedDict, total=False):
    resumeMajor: bool
    resumeMinor: bool


T = TypeVar("T")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class Body(Generic[T]):
    """A request body: its type, whether it may be empty, and its error codes."""

    def __init__(
        self,
        type_: type[T],
        *,
        required: bool = False,
        code: str = "invalid_body",
        pattern_code: str | None = None,
        nonempty: bool = False,
    ) -> None:
        self.type = type_
        self.adapter: TypeAdapter[T] = TypeAdapter(type_)
        self.required = required
        self.code = code  # any refusal but a string that misses its pattern
        self.pattern_code = pattern_code or code
        self.nonempty = nonempty  # an object with no keys is refused (minProperties 1)

    def parse(self, raw: bytes) -> T:
        if not raw.strip():
            if self.required or self.nonempty:
                raise ApiError(400, "invalid_body", f"a JSON body is required: {self._shape()}")
            return self.adapter.validate_python({})
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # too deep: not ours
            raise ApiError(400, "invalid_json", f"body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_body", f"body must be a JSON object: {self._shape()}")
        if self.nonempty and not data:
            raise ApiError(400, "invalid_body", f"name at least one key: {self._shape()}")
        try:
            return self.adapter.validate_python(data)
        except ValidationError as e:
            first = e.errors()[0]
            code = self.code
            if first["type"] == "string_pattern_mismatch":
                code = self.pattern_code
            where = ".".join(str(p) for p in first["loc"]) or "body"
            # reprlib: bounded in depth and length, whatever the body held
            message = f"{where}: {first['msg']} (got {reprlib.repr(first.get('input'))})"
            raise ApiError(400, code, message[:MESSAGE_LIMIT]) from None

    def _shape(self) -> str:
        keys = self.adapter.json_schema()["properties"]
        return "{" + ", ".join(f'"{k}"' for k in keys) + "}"


@with_config(REQUEST)
class OffloadRun(TypedDict, total=False):
    stream: Annotated[
        str,
        Field(pattern=NAME_PATTERN, description="Offload by this stream's policies"),
    ]
    ledgers: Annotated[
        list[Annotated[int, Field(ge=0, le=MAX_ID), INTEGRAL]],
        Field(description="Offload these ledgers (closed ones), whatever the policies"),
    ]


MetadataUrl = Annotated[
    str,
    Field(
        min_length=1,
        max_length=2048,
        description="The metadata store the caller means (etcd://host:port[,...]/prefix): a "
        "node of another store refuses (409 metadata_mismatch)",
    ),
]


@with_config(REQUEST)
class AutorecoveryAudit(TypedDict):
    metadataUrl: MetadataUrl
    lostNodeRecoveryDelaySeconds: NotRequired[
        Annotated[
            float,
            Field(
                ge=0,
                le=10**9,
                description="A node unregistered this long is lost (default: the node's "
                "lost_node_recovery_delay_s)",
            ),
        ]
    ]
    checkReplicas: NotRequired[
        Annotated[bool, Field(description="Also read every settled entry from each replica")]
    ]
    checkLedgers: NotRequired[
        Annotated[
            bool,
            Field(
                description="Also ask each replica of each settled fragment which of its ids "
                "it lacks, from its index (no payload read; implied by checkReplicas)"
            ),
        ]
    ]


@with_config(REQUEST)
class AutorecoveryRereplicate(TypedDict):
    metadataUrl: MetadataUrl
    ledgerId: Annotated[int, Field(ge=0, le=MAX_ID), INTEGRAL]


@with_config(REQUEST)
class AutorecoveryDecommission(TypedDict):
    metadataUrl: MetadataUrl
    nodeId: Annotated[str, Field(min_length=1, max_length=253, description="The node's id")]


SNAPSHOT_TARGET_PATTERN = "^(local|offload|file:///.*)$"
CHECK_NAME_PATTERN = f"^({'|'.join(CHECKS)})$"
AUDIT_SUMMARY_VERSION = 1  # node.audit.job.SUMMARY_VERSION (that module imports pyspark)
Counted = Annotated[int, Field(ge=0), INTEGRAL]
Instant = Annotated[int, Field(ge=0, description="ms since the epoch"), INTEGRAL]


@with_config(REQUEST)
class AuditSnapshotRequest(TypedDict, total=False):
    to: Annotated[
        str,
        Field(
            pattern=SNAPSHOT_TARGET_PATTERN,
            description='"local" (the default: a new directory under the node\'s snapshot '
            'directory), "offload" (the offload object store), or a file:// URI of a new or '
            "empty directory under the snapshot directory",
        ),
    ]


@with_config(REQUEST)
class AuditCheckResult(TypedDict):
    violations: Counted
    table: Annotated[str, Field(description="Where the job wrote the violations")]


@with_config(REQUEST)
class AuditGarbage(TypedDict):
    logs: Counted
    recordBytes: Counted
    referencedBytes: Counted
    gcLiveBytes: Counted
    garbageBytes: Counted
    table: str


@with_config(REQUEST)
class AuditReplicas(TypedDict):
    """What the replicas check looked at (node/audit/fleet.py)."""

    ledgers: Annotated[Counted, Field(description="Replicated ledgers, over every node's view")]
    ranges: Annotated[Counted, Field(description="(node, segment) ranges of entries checked")]
    openTailsCut: Annotated[
        Counted,
        Field(description="Open ledgers' last segments checked only up to the writer's LAC"),
    ]
    nodesWithoutSnapshot: Annotated[
        list[str], Field(description="Nodes that segments name but the audit had no snapshot of")
    ]
    nodesWithoutLedgers: Annotated[
        list[str], Field(description="Nodes whose snapshot came without the ledgers' metadata")
    ]


@with_config(REQUEST)
class AuditSummary(TypedDict):
    """The audit job's summary.json, as it writes it."""

    version: Literal[1]
    startedMs: Instant
    finishedMs: Instant
    auditTimeMs: Instant
    nodes: list[str]
    status: Literal["clean", "violations"]
    checks: Annotated[
        dict[Annotated[str, Field(pattern=CHECK_NAME_PATTERN)], AuditCheckResult],
        # Without it JSON Schema would let any other key through patternProperties; an
        # audit of no check is no audit, not a clean one.
        Field(min_length=1, json_schema_extra={"additionalProperties": False}),
    ]
    garbage: NotRequired[AuditGarbage]
    logAges: NotRequired[Annotated[dict[str, Counted], Field(description="Logs by age")]]
    replicas: NotRequired[AuditReplicas]


CREATE_LEDGER = Body(CreateLedger)
OFFLOAD_RUN = Body(OffloadRun)
STREAM_POLICIES = Body(StreamPolicies, code="invalid_policy")
CREATE_CURSOR = Body(CreateCursor, pattern_code="invalid_position")
POSITION_BODY = Body(PositionBody, required=True, pattern_code="invalid_position")
READ_ONLY = Body(ReadOnlyBody, required=True)
GC_REQUEST = Body(GcRequest)
SUSPEND = Body(SuspendCompaction, nonempty=True)
RESUME = Body(ResumeCompaction, nonempty=True)
AUDIT_SNAPSHOT = Body(AuditSnapshotRequest, pattern_code="invalid_target")
AUDIT_SUMMARY = Body(AuditSummary, required=True, code="invalid_summary")
AUTORECOVERY_AUDIT = Body(AutorecoveryAudit, required=True)
AUTORECOVERY_REREPLICATE = Body(AutorecoveryRereplicate, required=True)
AUTORECOVERY_DECOMMISSION = Body(AutorecoveryDecommission, required=True)
REQUEST_BODIES: tuple[Body[Any], ...] = (
    CREATE_LEDGER,
    STREAM_POLICIES,
    CREATE_CURSOR,
    POSITION_BODY,
    READ_ONLY,
    GC_REQUEST,
    SUSPEND,
    RESUME,
    OFFLOAD_RUN,
    AUDIT_SNAPSHOT,
    AUDIT_SUMMARY,
    AUTORECOVERY_AUDIT,
    AUTORECOVERY_REREPLICATE,
    AUTORECOVERY_DECOMMISSION,
)


# --- response bodies ---------------------------------------------------------------------


class Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class Error(Reply):
    code: str = Field(description="Stable, snake_case")
    message: str


LedgerStateName = Literal["open", "fenced", "closed", "deleted"]
LEDGER_STATES: dict[LedgerState, LedgerStateName] = {
    LedgerState.OPEN: "open",
    LedgerState.FENCED: "fenced",
    LedgerState.CLOSED: "closed",
    LedgerState.DELETED: "deleted",
}


OffloadStateName = Literal["none", "in_progress", "offloaded"]
OFFLOAD_STATES: dict[OffloadState, OffloadStateName] = {
    OffloadState.NONE: "none",
    OffloadState.IN_PROGRESS: "in_progress",
    OffloadState.OFFLOADED: "offloaded",
}


class LedgerOffload(Reply):
    state: OffloadStateName
    attempt: str | None
    bytes: Count
    localDeleted: bool


class LedgerReplication(Reply):
    """A replicated ledger's quorums (0/0/0: a fencing read created it before any add told
    them) and its writer's LAC as the adds carried it (``lac`` is the local durable prefix,
    which means nothing for a replica's stripe)."""

    ensembleSize: Annotated[int, Field(ge=0)]
    writeQuorumSize: Annotated[int, Field(ge=0)]
    ackQuorumSize: Annotated[int, Field(ge=0)]
    writerLac: Annotated[int, Field(ge=-1)]
    writerLacLength: Annotated[int, Field(ge=0)]


class Ledger(Reply):
    ledgerId: Id
    state: LedgerStateName
    lac: Annotated[int, Field(ge=-1)]
    lastEntryId: Annotated[int, Field(ge=-1)]
    entries: Count
    bytes: Count
    createdTime: Millis
    closedTime: Millis | None
    properties: dict[str, str]
    hasWriteToken: bool
    offload: LedgerOffload
    replication: LedgerReplication | None = None  # None: a node-local ledger


class LedgerList(Reply):
    ledgers: list[Ledger]


class AddResult(Reply):
    ledgerId: Id
    entryId: Id
    lac: Annotated[int, Field(ge=-1)]


class BatchResult(Reply):
    """A batch takes consecutive ids: the first and last name them all (a list of every id
    made a reply as big as the batch)."""

    ledgerId: Id
    firstEntryId: Id
    lastEntryId: Id
    lac: Annotated[int, Field(ge=-1)]


class Lac(Reply):
    ledgerId: Id
    lac: Annotated[int, Field(ge=-1)]


class ReplicaLac(Reply):
    """A replica's view of a replicated ledger (``?replicated=1``): the writer's LAC as its
    adds carried it, the bytes up to it, the highest entry id held here, and whether a
    recovery fenced it."""

    ledgerId: Id
    lac: Annotated[int, Field(ge=-1)]
    lacLength: Annotated[int, Field(ge=0)]
    lastEntryId: Annotated[int, Field(ge=-1)]
    fenced: bool


class ReplicaMissing(Reply):
    """What a replica lacks of a fragment (GET /api/v1/ledgers/{lid}/missing), from its index:
    ``missing`` ranges [first, last] of the ids asked about that it does not hold, up to
    ``checkedTo``; ``nextFrom`` when the reply stopped at its limit of ranges before ``to``."""

    ledgerId: Id
    checkedTo: Annotated[int, Field(ge=-1)]
    missing: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]]
    missingEntries: Annotated[int, Field(ge=0)]
    heldEntries: Annotated[int, Field(ge=0)]
    nextFrom: Annotated[int, Field(ge=0)] | None


class PolicyValues(Reply):
    """Every policy of ``node.streams.policies`` (a test holds the two lists equal)."""

    minLedgerRolloverTimeMinutes: int
    maxLedgerRolloverTimeMinutes: int
    maxEntriesPerLedger: int
    maxSizePerLedgerMbytes: int
    retentionTimeInMinutes: int
    retentionSizeInMB: int
    messageTtlInSeconds: int
    offloadThresholdInBytes: int
    offloadThresholdInSeconds: int
    offloadDeletionLagInMillis: int
    deduplication: bool


class StreamLedger(Reply):
    ledgerId: Id
    entries: Count
    bytes: Count
    createdTime: Millis
    closedTime: Millis | None


class Cursor(Reply):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    markDeletePosition: MarkDelete
    backlogEntries: Count
    backlogBytes: Count
    createdTime: Millis


class Replication(Reply):
    ensemble: Count
    writeQuorum: Count
    ackQuorum: Count


class Stream(Reply):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    createdTime: Millis
    policies: PolicyValues
    replication: Replication  # 1/1/1: the node's own ledgers (no metadata store)
    owner: str | None = None  # the node serving it (replicated streams); None: no metadata store
    ledgers: list[StreamLedger]
    entries: Count
    bytes: Count
    oldestDataTime: Millis | None
    cursors: list[Cursor]


class StreamList(Reply):
    total: Annotated[Count, Field(description="Streams in all (every page)")]
    offset: Count
    limit: Count
    streams: Annotated[list[Stream], Field(description="In name order")]


class Appended(Reply):
    position: Position


class ProducerSequence(Reply):
    """GET /api/v1/streams/{name}/producers/{producerId}: where the producer resumes."""

    producerId: Annotated[str, Field(pattern=NAME_PATTERN)]
    lastSequenceId: Annotated[
        int, Field(ge=0, le=MAX_ID, description="The highest id the stream holds")
    ]
    position: Annotated[Position, Field(description="Where that id's entry is stored")]


class AppendedBatch(Reply):
    """A batch lands in one ledger at consecutive entry ids: first and last name them all."""

    firstPosition: Position
    lastPosition: Position


KEPT_POSITIONS = (
    "Where it was stored the first time; null when that is older than the producer's last "
    "five runs of appends (the positions its table keeps), or an id a gap skipped"
)


class DuplicateAppended(Reply):
    """An append whose producer ids the stream holds (X-Duplicate: true): nothing written."""

    position: Annotated[Position | None, Field(description=KEPT_POSITIONS)]


class DuplicateBatch(Reply):
    """A batch whose producer ids the stream holds (X-Duplicate: true): nothing written."""

    firstPosition: Annotated[Position | None, Field(description=KEPT_POSITIONS)]
    lastPosition: Annotated[Position | None, Field(description=KEPT_POSITIONS)]


class RetentionDeletion(Reply):
    ledgerId: Id
    reason: Literal["time", "size", "disk"]
    bytes: Count


class RetentionResult(Reply):
    dryRun: bool
    streams: dict[str, list[RetentionDeletion]]


class GcStatus(Reply):
    forceCompacting: bool
    majorCompacting: bool
    minorCompacting: bool
    lastMajorCompactionTime: int
    lastMinorCompactionTime: int
    majorCompactionCounter: Count
    minorCompactionCounter: Count
    spaceCompactionCounter: Count
    spaceAmplification: float | None
    compactingLog: str | None
    compactingBytesDone: Count
    compactingBytesLeft: Count
    lastErrors: dict[str, str]
    unreadableLogs: list[str]


class BookieState(Reply):
    running: bool
    readOnly: bool
    shuttingDown: bool
    availableForHighPriorityWrites: bool


class ReadOnlyState(Reply):
    readOnly: bool


class Space(Reply):
    freeSpace: Count
    totalSpace: Count


TrueFalse = Literal["true", "false"]  # BookKeeper's answers are strings


class ForceGcState(Reply):
    is_in_force_gc: TrueFalse


class Suspension(Reply):
    isMajorGcSuspended: TrueFalse
    isMinorGcSuspended: TrueFalse


class AuditSnapshot(Reply):
    uri: Annotated[str, Field(description="Where the snapshot is: give it to the audit job")]
    url: Annotated[
        str | None,
        Field(
            description="The snapshot served by this node over HTTP (GET under "
            "/api/v1/audit/snapshots/): the audit job's --snapshot when its executors do not "
            "run beside the node's volume; null for a file:// target in a subdirectory"
        ),
    ] = None
    takenMs: Millis
    rows: dict[str, Count]


class AuditResult(Reply):
    receivedMs: Millis
    summary: AuditSummary


# --- the status page's routes (node/http/status.py) ---------------------------------------

Ratio = Annotated[float, Field(ge=0, description="0..1")]
Seconds = Annotated[float, Field(ge=0)]
PerSecond = Annotated[float, Field(ge=0)]
LogId = Annotated[str, Field(pattern="^[0-9a-f]+$", description="Entry log id, hex")]
NodeStateName = Literal["starting", "writable", "read_only", "shutting_down"]


DataDirName = Literal["journal", "ledgers", "index"]


class StatusDisk(Reply):
    dir: DataDirName
    path: str
    usedBytes: Count
    totalBytes: Count
    usage: Ratio


class StatusWatermarks(Reply):
    """The disk usage ratios the node acts at (settings)."""

    gc: Annotated[float, Field(description="gc_disk_usage_threshold: GC runs at once")]
    warn: Annotated[float, Field(description="disk_usage_warn_threshold: a warning")]
    readOnly: Annotated[float, Field(description="disk_usage_threshold: the node turns read-only")]
    writableAgain: Annotated[float, Field(description="disk_usage_lwm_threshold")]


class StatusWal(Reply):
    kind: Literal["journal", "blockdev"]
    healthy: bool
    problem: str | None
    queueBytes: Count
    checkpoints: Count
    lastCheckpoint: Annotated[str, Field(description="WAL position of the last checkpoint")]
    lastCheckpointMs: Annotated[
        Millis | None, Field(description="When the last checkpoint ended; null: none since start")
    ]
    sinceCheckpointBytes: Annotated[
        Count,
        Field(
            description="Entry bytes written since the last checkpoint, not yet in entry logs: "
            "what a start after a crash replays from the WAL"
        ),
    ]
    groupWrites: Annotated[Count, Field(description="WAL group writes (fsyncs) since start")]
    fsyncP50Seconds: Annotated[
        float | None, Field(description="Over the latest history interval with WAL writes")
    ]
    fsyncP99Seconds: float | None
    ringCapacityBytes: Count | None
    ringUsedBytes: Count | None
    blocksInFlight: Count | None
    throttledAppends: Count | None
    rejectedAppends: Count | None


class StatusCounters(Reply):
    """Totals since the node started."""

    adds: Count
    addBytes: Count
    reads: Count
    readBytes: Count
    throttledAdds: Count
    rejectedAdds: Count


class StatusGc(Reply):
    runs: Count
    failures: Count
    lastSuccessMs: Annotated[int, Field(ge=0, description="ms since the epoch; 0: none yet")]
    lastRunSeconds: Seconds
    intervalSeconds: Seconds
    deletedLedgers: Count
    reclaimedBytes: Count
    knownLogs: Annotated[Count, Field(description="Sealed logs GC measured at its last run")]
    inForceGc: bool
    majorSuspended: bool
    minorSuspended: bool
    details: GcStatus


class StatusRetention(Reply):
    runs: Count
    lastRunMs: Millis | None
    deletedLedgers: Count
    deletedBytes: Count
    schedulerEnabled: bool
    deleteWhen: Annotated[str, Field(description="Hours of the day the scheduler runs")]
    cleanAbove: Annotated[
        float,
        Field(
            description="disk_max_used_space_ratio: above it retention runs every "
            "pressureRunSeconds, by the streams' policies"
        ),
    ]
    pressureRunSeconds: Annotated[
        Seconds, Field(description="How often retention runs while a disk is past cleanAbove")
    ]
    forcedAbove: Annotated[
        float,
        Field(
            description="disk_space_clean_forcibly_ratio: above it retention deletes every "
            "acknowledged closed ledger, whatever the streams' retention"
        ),
    ]
    diskUsage: Annotated[float, Field(ge=0, description="The fullest data disk's usage")]
    diskPressure: Annotated[
        Literal["none", "cleaning", "forced"],
        Field(description="Which of the two the fullest data disk is past now"),
    ]


class StatusOffload(Reply):
    runs: Count
    lastRunMs: Millis | None
    lastError: str | None
    offloadedLedgers: Count
    offloadedBytes: Count
    inProgress: Count
    awaitingDeletionBytes: Count
    lagSeconds: Seconds
    uploadFailures: Count
    schedulerEnabled: bool


class StatusAudit(Reply):
    receivedMs: Millis
    finishedMs: Millis
    status: Literal["clean", "violations"]
    violations: dict[str, Count]


class StatusFleetNode(Reply):
    id: str
    zone: str
    state: Literal["writable", "readonly"]
    url: str


class StatusDependentLedger(Reply):
    """An open ledger whose last ensemble names the node: its writer needs that ensemble."""

    ledgerId: Annotated[
        str, Field(description="Decimal: replicated ledger ids exceed JavaScript's exact 2^53")
    ]
    state: Literal["OPEN", "IN_RECOVERY"]
    stream: Annotated[str | None, Field(description="The stream whose ledger it is, if one")]
    reachable: Annotated[
        Count, Field(description="Nodes of its last ensemble registered now (copies reachable)")
    ]
    ensembleSize: Count
    writeQuorum: Count
    ackQuorum: Annotated[Count, Field(description="Copies an add needs")]


class StatusFleetMember(Reply):
    """A node the metadata store knows: registered, holding a cookie, or named by a ledger."""

    id: str
    state: Annotated[
        Literal["registered", "read_only", "decommissioning", "unregistered", "lost"],
        Field(description="lost: unregistered past the lost-node delay (or so audited)"),
    ]
    url: Annotated[str | None, Field(description="Its registration's; null when unregistered")]
    zone: str | None
    registered: bool
    readOnly: bool
    decommissioning: bool
    cookie: Annotated[bool, Field(description="cookies/<id> held: it served in this cluster")]
    unregisteredSinceMs: Annotated[
        Millis | None,
        Field(description="The first sighting of it unregistered (lost/<id>: any node or audit)"),
    ]
    lostAtMs: Annotated[
        Millis | None,
        Field(description="When the lost-node delay is over: audits then re-replicate its copies"),
    ]
    ledgers: Annotated[Count, Field(description="Ledgers a segment of which names it")]
    openLedgerCount: Annotated[Count, Field(description="Open ledgers its last ensemble names")]
    openLedgers: Annotated[
        list[StatusDependentLedger], Field(description="The first of them, in ledger id order")
    ]
    streams: Annotated[list[str], Field(description="Streams whose open ledger names it")]


class StatusFleet(Reply):
    """Every node the store knows and what depends on it, read at most every cacheSeconds."""

    readMs: Annotated[Millis | None, Field(description="When read; null until a read succeeded")]
    cacheSeconds: Annotated[
        Seconds,
        Field(description="status_fleet_cache_s, or 10 times the last read's time when longer"),
    ]
    lostNodeDelaySeconds: Seconds
    ledgers: Count | None
    atRiskLedgers: Annotated[
        Count | None,
        Field(description="Ledgers a segment of which names a node not registered now"),
    ]
    atRiskOpenLedgers: Count | None
    unregisteredNodes: Count | None
    nodes: list[StatusFleetMember] | None
    error: Annotated[str | None, Field(description="Why the last read failed (view kept)")]


class StatusReplication(Reply):
    """Replicated ledgers: only ``enabled`` (false) on a node without a metadata store."""

    enabled: bool
    nodeId: str | None = None
    registered: Annotated[
        bool | None, Field(description="nodes/<id> held under a live lease in the store")
    ] = None
    clusterId: str | None = None
    instanceId: Annotated[
        str | None, Field(description="This data directory's cookie (new when it is wiped)")
    ] = None
    zone: str | None = None
    url: Annotated[str | None, Field(description="The URL the node registered")] = None
    replicatedLedgers: Count | None = None
    lastRegistrationError: str | None = None
    gcSweeps: Count | None = None
    gcReclaimed: Annotated[
        Count | None, Field(description="Replicas deleted: their ledger left the store")
    ] = None
    gcOverreplicatedReclaimed: Annotated[
        Count | None,
        Field(description="Replicas deleted: no segment of their ledger names this node"),
    ] = None
    gcSkipped: Annotated[
        Count | None, Field(description="Replicas kept: the store could not confirm")
    ] = None
    streamsOwned: Annotated[
        Count | None, Field(description="Replicated streams this node serves (owns) now")
    ] = None
    streamTakeovers: Annotated[
        Count | None, Field(description="Streams this node took over from no live owner")
    ] = None
    streamRequestsForwarded: Annotated[
        Count | None, Field(description="Stream requests sent on to another node, the owner")
    ] = None
    # The fleet's autorecovery, as the store said at the last poll (autorecovery_poll_s).
    underReplicatedLedgers: Annotated[
        Count | None, Field(description="Ledgers with a marker after the last audit (fleet)")
    ] = None
    underReplicatedFragments: Count | None = None
    lostNodes: Annotated[
        Count | None, Field(description="Nodes gone longer than the lost-node delay")
    ] = None
    decommissioningNodes: Count | None = None
    lostNodeIds: Annotated[
        list[str] | None, Field(description="When the last audit report listed them")
    ] = None
    decommissioningNodeIds: list[str] | None = None
    lastAuditorRunMs: Annotated[
        Millis | None, Field(description="When the last audit finished; null: none yet")
    ] = None
    rereplicatedFragments: Count | None = None
    rereplicatedEntries: Count | None = None
    rereplicatedBytes: Count | None = None
    nodes: Annotated[
        list[StatusFleetNode] | None,
        Field(description="The registered nodes (nodes/ in the store); null until read once"),
    ] = None
    lastAutorecoveryPollMs: Annotated[
        Millis | None, Field(description="The last read of the store that succeeded")
    ] = None
    autorecoveryPollErrors: Count | None = None
    lastAutorecoveryPollError: Annotated[
        str | None, Field(description="Why the last read failed; null when it succeeded")
    ] = None
    fleet: Annotated[
        StatusFleet | None, Field(description="Every node the store knows (the fleet view)")
    ] = None


class StatusCursor(Reply):
    name: str
    markDeletePosition: MarkDelete
    backlogEntries: Count
    backlogBytes: Count
    oldestUnacknowledgedAgeSeconds: Annotated[
        Seconds, Field(description="Age of the ledger holding the next unacknowledged entry")
    ]


class StatusDedup(Reply):
    """A deduplicating stream's producer table on this node (node/streams/dedup.py)."""

    duplicates: Annotated[Count, Field(description="Appends answered as duplicates")]
    producers: Annotated[Count, Field(description="Producers tracked")]
    snapshotAgeSeconds: Annotated[
        float, Field(description="Age of the table's snapshot; -1: none taken or loaded yet")
    ]


class StatusStream(Reply):
    name: str
    ledgers: Count
    retainedBytes: Count
    cursors: Annotated[
        list[StatusCursor],
        Field(description="In the summary, metrics_max_streams cursors at most in all"),
    ]
    cursorCount: Annotated[Count, Field(description="All of the stream's cursors")]
    deduplication: Annotated[
        StatusDedup | None, Field(description="null: the stream does not deduplicate")
    ] = None


class StatusStreamTotals(Reply):
    """Over every stream, those the summary leaves out included."""

    streams: Count
    shown: Annotated[
        Count, Field(description="Streams in the summary: metrics_max_streams at most")
    ]
    cursors: Count
    backlogEntries: Count
    backlogBytes: Count
    retainedBytes: Count
    oldestUnacknowledgedAgeSeconds: Annotated[Seconds, Field(description="Of any cursor")]


class StatusStreamPage(Reply):
    total: Count
    offset: Count
    limit: Count
    streams: Annotated[list[StatusStream], Field(description="In name order")]


class StatusSummary(Reply):
    nodeId: Count
    version: str
    state: NodeStateName
    readOnlyReason: str | None
    nowMs: Millis
    startedMs: Millis
    adminTokenRequired: bool
    disks: list[StatusDisk]
    watermarks: StatusWatermarks
    wal: StatusWal
    counters: StatusCounters
    gc: StatusGc
    retention: StatusRetention
    offload: StatusOffload
    audit: StatusAudit | None
    streams: Annotated[
        list[StatusStream],
        Field(description="The largest cursor backlog first; all: /api/v1/status/streams"),
    ]
    streamTotals: StatusStreamTotals
    replication: StatusReplication


class StatusSample(Reply):
    """One interval of the history; a quantile is null when the interval observed nothing."""

    timeMs: Millis
    addsPerSecond: PerSecond
    readsPerSecond: PerSecond
    addBytesPerSecond: PerSecond
    readBytesPerSecond: PerSecond
    addP50Seconds: float | None
    addP99Seconds: float | None
    fsyncP50Seconds: float | None
    fsyncP99Seconds: float | None


class StatusHistory(Reply):
    intervalSeconds: Seconds
    windowSeconds: Seconds
    samples: Annotated[list[StatusSample], Field(description="Oldest first")]


class StatusLogCell(Reply):
    logId: LogId
    sizeBytes: Count
    ageSeconds: Annotated[Seconds, Field(description="Since the log was last written (mtime)")]
    sealed: Annotated[bool, Field(description="False: being written; no ledgers map yet")]
    ledgers: Count | None
    liveBytes: Count | None
    usage: Annotated[
        float | None, Field(ge=0, le=1, description="Live bytes over the log's own size")
    ]


class StatusPin(Reply):
    ledgerId: Id
    bytes: Annotated[Count, Field(description="The ledger's bytes in this log")]
    reason: PinReason
    detail: str
    stream: str | None
    cursor: str | None


class StatusPinnedLog(Reply):
    logId: LogId
    ageSeconds: Seconds
    liveLedgers: Count
    old: Annotated[
        bool, Field(description="Older than oldAfterSeconds: pinned past retention and GC")
    ]
    pins: Annotated[list[StatusPin], Field(description="The largest first")]


class StatusEntryLogs(Reply):
    nowMs: Millis
    logSizeLimitBytes: Count
    oldAfterSeconds: Annotated[
        Seconds,
        Field(
            description="default retention time + major compaction interval: a log with live "
            "data past this age is pinned (the audit's pinned check, the EntryLogPinned alert)"
        ),
    ]
    logs: list[StatusLogCell]
    oldestPinned: Annotated[
        list[StatusPinnedLog], Field(description="The oldest sealed logs that hold live data")
    ]


RESPONSE_MODELS: tuple[type[Reply], ...] = (
    Error,
    Ledger,
    LedgerList,
    AddResult,
    BatchResult,
    Lac,
    ReplicaLac,
    ReplicaMissing,
    Cursor,
    Stream,
    StreamList,
    Appended,
    AppendedBatch,
    DuplicateAppended,
    DuplicateBatch,
    ProducerSequence,
    RetentionResult,
    GcStatus,
    BookieState,
    ReadOnlyState,
    Space,
    ForceGcState,
    Suspension,
    AuditSnapshot,
    AuditResult,
    StatusSummary,
    StatusStreamPage,
    StatusHistory,
    StatusEntryLogs,
)


def component_schemas() -> dict[str, Any]:
    """Every body's JSON schema by name, nested models hoisted to the top level."""
    schemas: dict[str, Any] = {}
    types: list[Any] = [body.type for body in REQUEST_BODIES] + list(RESPONSE_MODELS)
    for tp in types:
        schema = TypeAdapter(tp).json_schema(ref_template=REF_TEMPLATE)
        schemas.update(schema.pop("$defs", {}))
        schemas[tp.__name__] = schema
    return schemas
