"""The stream policies (Pulsar's names), each declared once: its bounds, what it means, and
the setting that holds the node's default for it.

A stream stores its policies with it (``Stream.policies``); a PUT names some and the others
take the node's defaults (``default_policies``). The HTTP API takes its bounds and
descriptions from here (``POLICIES``); the rules that read the values are in
``node.streams.rules``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from node.settings import MiB, Settings

# Policy values are Java ints in Pulsar (retentionSizeInMB a long): clients and tools that
# read them back in another language hold them in those types.
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
_RULE = "policy"  # the dataclass field metadata key of a policy's PolicyRule


class PolicyConflict(ValueError):
    """Each value is allowed, but together they are not (a rule between two policies)."""


@dataclass(frozen=True, slots=True)
class PolicyRule:
    low: int  # smallest allowed value
    high: int  # largest allowed value: Pulsar's type, and a byte count in an int64
    description: str  # as the API documents it
    setting: str | None  # the Settings field holding the node's default; None: no setting
    boolean: bool = False  # true or false (low and high are 0 and 1)


def _policy(
    setting: str | None, low: int, high: int, description: str, *, boolean: bool = False
) -> Any:
    """A policy field whose default is its setting's default (0 without a setting)."""
    default = 0 if setting is None else Settings.model_fields[setting].default
    rule = PolicyRule(low, high, description, setting, boolean)
    return field(default=default, metadata={_RULE: rule})


@dataclass(slots=True)
class Policies:
    """-1 = unlimited (off for the offload thresholds), TTL 0 = none."""

    minLedgerRolloverTimeMinutes: int = _policy(
        "managed_ledger_min_ledger_rollover_time_minutes",
        0,
        INT32_MAX,
        "No rollover before this age",
    )
    maxLedgerRolloverTimeMinutes: int = _policy(
        "managed_ledger_max_ledger_rollover_time_minutes", 0, INT32_MAX, "Roll over at this age"
    )
    maxEntriesPerLedger: int = _policy(
        "managed_ledger_max_entries_per_ledger", 1, INT32_MAX, "Roll over at this many"
    )
    maxSizePerLedgerMbytes: int = _policy(
        "managed_ledger_max_size_per_ledger_mbytes", 1, INT32_MAX, "Roll over at this size"
    )
    retentionTimeInMinutes: int = _policy(
        "default_retention_time_in_minutes",
        -1,
        INT32_MAX,
        "Keep acknowledged data this long; -1 = forever",
    )
    retentionSizeInMB: int = _policy(
        "default_retention_size_in_mb",
        -1,
        INT64_MAX // MiB,
        "Keep at least this much; -1 = no limit",
    )
    messageTtlInSeconds: int = _policy(
        None, 0, INT32_MAX, "Cursors skip data older than this; 0 = none"
    )
    offloadThresholdInBytes: int = _policy(  # Pulsar: a long
        "managed_ledger_offload_threshold_in_bytes",
        -1,
        INT64_MAX,
        "Keep the newest N bytes local; -1 = off",
    )
    offloadThresholdInSeconds: int = _policy(  # as milliseconds, still an int64
        "managed_ledger_offload_threshold_in_seconds",
        -1,
        INT64_MAX // 1000,
        "Offload ledgers closed longer ago; -1 = off",
    )
    offloadDeletionLagInMillis: int = _policy(
        "managed_ledger_offload_deletion_lag_ms", 0, INT64_MAX, "Then the local copy goes"
    )
    # Pulsar's deduplicationEnabled: takes effect at the stream's next ledger (its ledgers
    # carry producer headers or not, as they were created; node.streams.dedup)
    deduplication: bool = _policy(
        "stream_deduplication_enabled",
        0,
        1,
        "Appends with X-Producer-Id and X-Sequence-Id land once",
        boolean=True,
    )

    @classmethod
    def from_json(cls, given: dict[str, Any], defaults: Policies) -> Policies:
        """``given`` over ``defaults``; ValueError naming the bad key, PolicyConflict when the
        values are each allowed but not together."""
        unknown = set(given) - set(POLICIES)
        if unknown:
            raise ValueError(f"unknown policy {sorted(unknown)[0]!r}; known: {', '.join(POLICIES)}")
        values = defaults.to_json()
        for key, value in given.items():
            low, high = POLICIES[key].low, POLICIES[key].high
            if POLICIES[key].boolean:
                if type(value) is not bool:
                    raise ValueError(f"{key} must be true or false, got {value!r}")
            elif type(value) is not int or not low <= value <= high:
                raise ValueError(f"{key} must be an integer in [{low}, {high}], got {value!r}")
            values[key] = value
        policies = cls(**values)
        if policies.minLedgerRolloverTimeMinutes > policies.maxLedgerRolloverTimeMinutes:
            raise PolicyConflict(
                f"minLedgerRolloverTimeMinutes ({policies.minLedgerRolloverTimeMinutes}) exceeds "
                f"maxLedgerRolloverTimeMinutes ({policies.maxLedgerRolloverTimeMinutes})"
            )
        return policies

    def to_json(self) -> dict[str, Any]:  # ints, and deduplication a bool
        return {key: getattr(self, key) for key in POLICIES}


POLICIES: dict[str, PolicyRule] = {f.name: f.metadata[_RULE] for f in fields(Policies)}


def default_policies(settings: Settings) -> Policies:
    """The node's defaults, from its settings."""
    return Policies(
        **{
            name: getattr(settings, rule.setting)
            for name, rule in POLICIES.items()
            if rule.setting is not None
        }
    )
