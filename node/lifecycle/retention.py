"""Retention of streams (Pulsar's trim rule, RocketMQ's scheduling): the runs, their
triggers and their logs. Which ledgers go is ``node.streams.rules`` (``plan_deletions``).

When: ``POST /api/v1/retention/run`` (with a dry run), every day at the hours of
``delete_when`` when ``retention_scheduler_enabled`` (turn it off when Airflow drives
retention), and at every scheduler tick (30 s) while a data disk is past
``disk_max_used_space_ratio``. Deletions are paced by ``delete_commit_log_files_interval_ms``.
Deleted ledgers' space comes back with GC.

A run under disk pressure that deletes logs it at WARNING, naming the ledgers, the disk's
usage and the threshold passed: on a shared disk the node may delete data its owners
thought retained, and the log must say so; entering and leaving the pressure modes is
logged too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from node.offload.service import FleetStreams
from node.settings import Settings
from node.storage.clock import Clock
from node.storage.errors import StorageError
from node.streams import rules
from node.streams.manager import StreamManager
from node.streams.rules import Deletion

log = logging.getLogger(__name__)

SCHEDULER_TICK_S = 30.0  # how often the scheduler looks at the clock and the disks
HOUR_S = 3600
LOGGED_LEDGERS = 20  # ledgers named per stream in a pressure run's warning; the rest counted

Pressure = Literal["none", "cleaning", "forced"]


def disk_pressure(settings: Settings, usage: float) -> Pressure:
    """Which retention mode the fullest data disk's ``usage`` puts the node in: "cleaning"
    past disk_max_used_space_ratio (runs every tick, by the streams' policies), "forced"
    past disk_space_clean_forcibly_ratio (acknowledged ledgers go whatever their policy)."""
    if usage > settings.disk_space_clean_forcibly_ratio:
        return "forced"
    if usage > settings.disk_max_used_space_ratio:
        return "cleaning"
    return "none"


def _pressure_text(settings: Settings, pressure: Pressure, usage: float) -> str:
    if pressure == "forced":
        return (
            f"data disk {usage:.0%} full, past disk_space_clean_forcibly_ratio "
            f"{settings.disk_space_clean_forcibly_ratio:.0%}: acknowledged closed ledgers are "
            "deleted whatever the streams' retention"
        )
    return (
        f"data disk {usage:.0%} full, past disk_max_used_space_ratio "
        f"{settings.disk_max_used_space_ratio:.0%}: retention runs every "
        f"{SCHEDULER_TICK_S:.0f} s"
    )


def _named(plan: list[Deletion]) -> str:
    shown = ", ".join(
        f"{d.ledger_id} ({d.reason}, {d.size_bytes} bytes)" for d in plan[:LOGGED_LEDGERS]
    )
    more = len(plan) - LOGGED_LEDGERS
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass(slots=True)
class RetentionStats:
    runs: int = 0
    deleted: dict[tuple[str, str], int] = field(default_factory=dict)  # (stream, reason)
    deleted_bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (stream, reason)
    expired_cursor_moves: int = 0
    last_run_ms: int = 0  # wall clock of the last run's end; 0: none since start


class Retention:
    def __init__(
        self,
        streams: StreamManager,
        clock: Clock,
        disk_usage: Callable[[], float],
        fleet: FleetStreams | None = None,
    ) -> None:
        self._streams = streams
        self._fleet = fleet  # with a metadata store: streams no live node owns are taken over
        self._settings = streams._settings
        self._clock = clock
        self._disk_usage = disk_usage
        self._lock = asyncio.Lock()
        self.stats = RetentionStats()
        self._last_scheduled_hour: int | None = None
        self._pressure: Pressure = "none"  # as the scheduler last saw it (logged on change)

    def plan(self, name: str, forced: bool, now_ms: int | None = None) -> list[Deletion]:
        """What a run at ``now_ms`` (default: now) deletes of the stream, the message TTL
        applied as the run applies it (a dry run moves no cursor but plans as if it had)."""
        now = self._clock.now_ms() if now_ms is None else now_ms
        stream = self._streams.stream(name)
        marks = (c.mark_delete for c in self._streams.cursors(name))
        return rules.plan_deletions(stream, rules.retention_mark(stream, marks, now), now, forced)

    async def run(
        self, dry_run: bool = False, forced: bool | None = None
    ) -> dict[str, list[Deletion]]:
        """One retention pass over every stream; what was (or would be) deleted."""
        async with self._lock:
            usage = await asyncio.to_thread(self._disk_usage)
            pressure = disk_pressure(self._settings, usage)
            if forced is None:
                forced = pressure == "forced"
            self.stats.runs += 0 if dry_run else 1
            if self._fleet is not None and not dry_run:
                # A stream whose owner died and that no client asked for since has no owner
                # to run its retention: this node takes it (a dry run changes nothing).
                await self._fleet.take_over_unowned()
            await self.roll_idle()  # a dry run too: a rollover is no deletion
            done: dict[str, list[Deletion]] = {}
            for stream in self._streams.streams():
                now = self._clock.now_ms()
                expired = rules.ttl_mark(stream, now)
                if expired is not None and not dry_run:
                    moved = await self._streams.expire(stream.name, expired)
                    self.stats.expired_cursor_moves += len(moved)
                plan = self.plan(stream.name, forced, now)
                if not plan:
                    continue
                done[stream.name] = plan
                if dry_run:
                    continue
                pace = self._settings.delete_commit_log_files_interval_ms / 1000
                await self._streams.trim(stream.name, [d.ledger_id for d in plan], pace)
                for deletion in plan:
                    key = (stream.name, deletion.reason)
                    self.stats.deleted[key] = self.stats.deleted.get(key, 0) + 1
                    bytes_so_far = self.stats.deleted_bytes.get(key, 0)
                    self.stats.deleted_bytes[key] = bytes_so_far + deletion.size_bytes
                if pressure == "none":
                    log.info(
                        "retention deleted %d ledgers of stream %s (%s)",
                        len(plan), stream.name, ", ".join(sorted({d.reason for d in plan})),
                    )  # fmt: skip
                else:
                    log.warning(
                        "retention under disk pressure (%s) deleted %d ledgers of stream %s: %s",
                        _pressure_text(self._settings, pressure, usage),
                        len(plan), stream.name, _named(plan),
                    )  # fmt: skip
            if not dry_run:  # a run that finished: the "retention not running" alert's clock
                self.stats.last_run_ms = self._clock.now_ms()
            return done

    async def roll_idle(self) -> None:
        """Pulsar's scheduled rollover: a full ledger that no append comes to rolls, so
        that retention reaches its data. A failure (a read-only disk) waits for the next."""
        for stream in self._streams.streams():
            try:
                await self._streams.roll_if_full(stream.name)
            except StorageError as e:
                log.warning("stream %s: scheduled rollover failed: %s", stream.name, e)

    def _due_hours(self) -> set[int]:
        return {int(h) for h in self._settings.delete_when.split(";") if h.strip().isdigit()}

    def _note_pressure(self, pressure: Pressure, usage: float) -> None:
        if pressure == self._pressure:
            return
        if pressure == "none":
            log.info("data disk %.0f%% full: retention is back to its schedule", usage * 100)
        else:
            log.warning("%s", _pressure_text(self._settings, pressure, usage))
        self._pressure = pressure

    async def run_forever(self) -> None:
        """RocketMQ's triggers: the hours of ``delete_when``, and a disk past the cleaning
        watermark (checked every tick, so a filling disk is cleaned within seconds)."""
        while True:
            await self._clock.sleep(SCHEDULER_TICK_S)
            try:
                await self.roll_idle()
                hour = time.localtime(self._clock.now_ms() / 1000).tm_hour
                scheduled = (
                    self._settings.retention_scheduler_enabled
                    and hour in self._due_hours()
                    and self._last_scheduled_hour != hour
                )
                if scheduled:
                    self._last_scheduled_hour = hour
                usage = await asyncio.to_thread(self._disk_usage)
                self._note_pressure(disk_pressure(self._settings, usage), usage)
                if scheduled or self._pressure != "none":
                    await self.run()
                elif hour not in self._due_hours():
                    self._last_scheduled_hour = None
            except Exception:
                log.exception("retention run failed; trying again at the next tick")
