"""The stream checker against crafted histories and read-backs: a clean run (across a
takeover's new ledger) passes, and each way a stream can contradict its history is caught
and named, with the position."""

from __future__ import annotations

from node.jepsen.checker import Observation, check
from node.jepsen.history import Op, OpFunction, OpType, digest
from node.jepsen.streams import KINDS, as_ledger_history, check_stream, unplaced_appends

OLD, NEW = 5, 9  # the ledger before a takeover, the one after


class Builder:
    """Operations with explicit times (the real-time rule reads them)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.t = 0.0

    def _at(self) -> float:
        self.t += 1.0
        return self.t

    def call(self, p: str, f: OpFunction, at: str | None = None, outcome: OpType = "ok") -> None:
        """A cursor reader's create, ack or reset (``at``: its position)."""
        ledger, entry = (None, None) if at is None else map(int, at.split(":"))
        self.ops.append(Op(p, "invoke", f, ledger, entry, None, self._at()))
        self.ops.append(Op(p, outcome, f, ledger, entry, None, self._at()))

    def read(
        self,
        p: str,
        got: list[tuple[str, str]],
        f: OpFunction = "cursor_read",
        at: str | None = None,
        limit: int = 2,
    ) -> None:
        """A read that got ``got`` ((position, payload) each); a plain one from ``at``."""
        ledger, entry = (None, None) if at is None else map(int, at.split(":"))
        self.ops.append(Op(p, "invoke", f, ledger, entry, None, self._at(), limit))
        digests = [digest(name.encode()) for _, name in got]
        positions = [position for position, _ in got]
        done = Op(p, "ok", f, ledger, entry, digests, self._at(), limit, None, positions)
        self.ops.append(done)

    def op(self, p: str, outcome: str, names: list[str], at: tuple[int, int] | None = None) -> None:
        """``p`` invokes an append of ``names`` (a batch when several), then it ends with
        ``outcome`` (ok: at position ``at``; None: never, its process died)."""
        f: OpFunction = "append" if len(names) == 1 else "append_batch"
        d: str | list[str] = (
            digest(names[0].encode()) if len(names) == 1 else [digest(n.encode()) for n in names]
        )
        self.ops.append(Op(p, "invoke", f, None, None, d, self._at()))
        if outcome == "ok":
            assert at is not None
            self.ops.append(Op(p, "ok", f, at[0], at[1], d, self._at()))
        elif outcome is not None:
            self.ops.append(Op(p, outcome, f, None, None, d, self._at()))


def clean() -> tuple[Builder, list[tuple[str, bytes]]]:
    """w0 appends three entries (ok), w1 a batch of two (ok), w2 one whose outcome is unknown
    (it landed), one that failed and one unknown that did not land; then a takeover: w0 and
    w1 go on in ledger NEW; w1's last append never got an answer (it is there)."""
    b = Builder()
    b.op("w0", "ok", ["w0-1"], (OLD, 0))
    b.op("w0", "ok", ["w0-2"], (OLD, 1))
    b.op("w1", "ok", ["w1-1", "w1-2"], (OLD, 2))
    b.op("w0", "ok", ["w0-3"], (OLD, 4))
    b.op("w2", "info", ["w2-1"])
    b.op("w2", "fail", ["w2-2"])
    b.op("w2", "info", ["w2-3"])
    b.op("w0", "ok", ["w0-4"], (NEW, 0))
    b.op("w1", "ok", ["w1-3"], (NEW, 1))
    b.op("w1", None, ["w1-4"])
    read = [
        (f"{OLD}:0", b"w0-1"),
        (f"{OLD}:1", b"w0-2"),
        (f"{OLD}:2", b"w1-1"),
        (f"{OLD}:3", b"w1-2"),
        (f"{OLD}:4", b"w0-3"),
        (f"{OLD}:5", b"w2-1"),
        (f"{NEW}:0", b"w0-4"),
        (f"{NEW}:1", b"w1-3"),
        (f"{NEW}:2", b"w1-4"),
    ]
    return b, read


def kinds(ops: list[Op], read: list[tuple[str, bytes]]) -> set[str]:
    return check_stream(ops, read).kinds()


def test_a_clean_history_across_a_takeover_is_clean() -> None:
    b, read = clean()
    verdict = check_stream(b.ops, read)
    assert verdict.ok, verdict
    assert verdict.counts == {
        "ok": 6,
        "fail": 1,
        "info": 2,
        "unfinished": 1,
        "acked_entries": 7,
        "read": 9,
        "reads": 0,
        "reads_ok": 0,
        "read_entries": 0,
    }


def test_unknown_appends_may_be_absent() -> None:
    b, read = clean()
    assert check_stream(b.ops, [r for r in read if r[1] not in (b"w2-1", b"w1-4")]).ok


def test_a_lost_acknowledged_append() -> None:
    b, read = clean()
    verdict = check_stream(b.ops, [r for r in read if r[1] != b"w0-3"])
    assert verdict.kinds() == {"lost"}
    [violation] = verdict.violations
    assert (violation.ledger, violation.entry) == (OLD, 4)
    assert "w0" in violation.detail


def test_an_entry_of_an_acknowledged_batch_lost() -> None:
    b, read = clean()
    verdict = check_stream(b.ops, [r for r in read if r[1] != b"w1-2"])
    assert verdict.kinds() == {"lost"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(OLD, 3)]


def test_a_duplicate_of_an_acknowledged_append() -> None:
    """Appended twice (a retry inside the node, a replay after the takeover)."""
    b, read = clean()
    verdict = check_stream(b.ops, [*read, (f"{NEW}:3", b"w0-2")])
    assert verdict.kinds() == {"duplicate"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(NEW, 3)]


def test_an_unknown_append_present_twice() -> None:
    b, read = clean()
    assert kinds(b.ops, [*read, (f"{NEW}:3", b"w2-1")]) == {"duplicate"}


def test_positions_read_back_out_of_order() -> None:
    b, read = clean()
    read[6], read[7] = read[7], read[6]  # NEW:1 read before NEW:0
    verdict = check_stream(b.ops, read)
    assert "order" in verdict.kinds()
    assert "writer_order" not in verdict.kinds()  # w0 and w1 each still in order
    assert [(v.ledger, v.entry) for v in verdict.violations if v.kind == "order"] == [(NEW, 0)]


def test_a_position_repeated_in_the_read_back() -> None:
    b, read = clean()
    read[7] = (f"{NEW}:0", b"w1-3")
    assert {"order", "position"} <= kinds(b.ops, read)


def test_a_writers_appends_reordered() -> None:
    """w0's appends read back in the order other than it made them, at the positions it was
    told: the node acknowledged w0-2 before w0-1's position (the acks say so, too)."""
    b = Builder()
    b.op("w0", "ok", ["w0-1"], (OLD, 1))
    b.op("w0", "ok", ["w0-2"], (OLD, 0))
    verdict = check_stream(b.ops, [(f"{OLD}:0", b"w0-2"), (f"{OLD}:1", b"w0-1")])
    assert verdict.kinds() == {"writer_order", "realtime"}
    assert {(v.ledger, v.entry) for v in verdict.violations} == {(OLD, 0)}


def test_a_phantom() -> None:
    b, read = clean()
    verdict = check_stream(b.ops, [*read, (f"{NEW}:3", b"ghost")])
    assert verdict.kinds() == {"phantom"}


def test_a_failed_append_that_is_present() -> None:
    b, read = clean()
    verdict = check_stream(b.ops, [*read, (f"{NEW}:3", b"w2-2")])
    assert verdict.kinds() == {"failed_present"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(NEW, 3)]


def test_an_acknowledged_append_at_another_position() -> None:
    """The old owner acknowledged w0-4 at NEW:0, but it is in the stream at OLD:6."""
    b, read = clean()
    read[6] = (f"{OLD}:6", b"w0-4")
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"position"}
    [violation] = verdict.violations
    assert (violation.ledger, violation.entry) == (NEW, 0)
    assert f"{OLD}:6" in violation.detail


def test_two_appends_acknowledged_at_one_position() -> None:
    b = Builder()
    b.op("w0", "ok", ["w0-1"], (OLD, 0))
    b.op("w1", "ok", ["w1-1"], (OLD, 0))
    verdict = check_stream(b.ops, [(f"{OLD}:0", b"w0-1"), (f"{OLD}:1", b"w1-1")])
    assert {"twice", "position", "realtime"} == verdict.kinds()


def test_an_append_acknowledged_before_another_was_invoked_is_earlier() -> None:
    """w1 is invoked after w0's append was acknowledged at OLD:1; it gets OLD:0 (a stale
    owner's ledger position, say): linearizability is broken even though every entry is there
    where it was acknowledged."""
    b = Builder()
    b.op("w0", "ok", ["w0-1"], (OLD, 1))
    b.op("w1", "ok", ["w1-1"], (OLD, 0))
    verdict = check_stream(b.ops, [(f"{OLD}:0", b"w1-1"), (f"{OLD}:1", b"w0-1")])
    assert verdict.kinds() == {"realtime"}


def test_concurrent_appends_may_land_in_either_order() -> None:
    b = Builder()
    b.ops += [
        Op("w0", "invoke", "append", None, None, digest(b"w0-1"), 1.0),
        Op("w1", "invoke", "append", None, None, digest(b"w1-1"), 2.0),
        Op("w1", "ok", "append", OLD, 0, digest(b"w1-1"), 3.0),
        Op("w0", "ok", "append", OLD, 1, digest(b"w0-1"), 4.0),
    ]
    assert check_stream(b.ops, [(f"{OLD}:0", b"w1-1"), (f"{OLD}:1", b"w0-1")]).ok


def test_every_kind_is_documented_and_verdicts_name_them() -> None:
    b, read = clean()
    verdict = check_stream(b.ops, [r for r in read if r[1] != b"w0-1"] + [(f"{NEW}:3", b"x")])
    assert verdict.kinds() <= set(KINDS)
    text = str(verdict)
    assert "lost: ledger 5 entry 0" in text and "phantom: ledger 9 entry 3" in text


def test_the_stream_as_the_ledger_checkers_history() -> None:
    """Each closed ledger of the stream, as its replicas hold it, checked by the replicated
    ledgers' checker: clean when the replicas hold what the cursor read; an entry the cursor
    never saw is a phantom; an acknowledged append the replicas lack is short."""
    b, read = clean()
    ops = as_ledger_history(b.ops, read, {OLD})
    assert {op.ledger for op in ops} == {OLD}
    assert sorted(op.f for op in ops if op.type == "ok") == ["add", "add", "add", "add_batch"]
    held = [(int(p.split(":")[1]), payload) for p, payload in read if p.startswith(f"{OLD}:")]
    whole = Observation.of("r0", "CLOSED", 5, held)
    assert check(ops, {OLD: [whole]}).ok
    extra = Observation.of("r0", "CLOSED", 6, [*held, (6, b"w2-3")])
    assert check(ops, {OLD: [extra]}).kinds() == {"phantom"}
    cut = Observation.of("r0", "CLOSED", 3, held[:4])
    assert check(ops, {OLD: [cut]}).kinds() == {"short"}


def test_an_unacknowledged_appends_bytes_past_a_closed_ledgers_end_are_a_leftover() -> None:
    """A paused owner's append that reached its own replica before the takeover fenced the
    others: recovery ends the ledger before it, and the append's answer was lost (info), never
    came (its process died) or was a refusal (the owner had lost the stream): the history
    names no ledger, and the owner's replica keeps the bytes past the recovered end. A
    leftover, not a phantom; an acknowledged append's bytes there, or bytes no append
    carried, still are not, nor an unacknowledged append's bytes inside the range."""
    b, read = clean()
    ops = as_ledger_history(b.ops, read, {OLD})
    unplaced = unplaced_appends(b.ops)
    assert unplaced == {digest(n) for n in (b"w2-1", b"w2-2", b"w2-3", b"w1-4")}
    held = [(int(p.split(":")[1]), payload) for p, payload in read if p.startswith(f"{OLD}:")]
    for name in (b"w2-2", b"w2-3", b"w1-4"):
        view = Observation.of("r0", "CLOSED", 5, held)
        view.past_end.append((6, "n1", digest(name)))
        assert check(ops, {OLD: [view]}).kinds() == {"phantom"}  # without the stream's word
        verdict = check(ops, {OLD: [view]}, unplaced)
        assert verdict.ok, verdict
        assert verdict.counts["leftovers"] == 1
    for name in (b"w0-4", b"ghost"):
        view = Observation.of("r0", "CLOSED", 5, held)
        view.past_end.append((6, "n1", digest(name)))
        assert check(ops, {OLD: [view]}, unplaced).kinds() == {"phantom"}
    for name in (b"w2-2", b"w2-3"):
        inside = Observation.of("r0", "CLOSED", 6, [*held, (6, name)])
        assert check(ops, {OLD: [inside]}, unplaced).kinds() == {"phantom"}


def test_a_producers_retried_appends_first_bytes_past_a_ledgers_end_are_a_leftover() -> None:
    """A producer's append (the same payload sent again after an unknown outcome) whose first
    attempt was fenced past the old ledger's end and whose retry was acknowledged in the new
    ledger: its bytes past the old end are a leftover; an append acknowledged at its only
    attempt is not."""
    b = Builder()
    b.op("w0", "ok", ["w0-1"], (OLD, 0))
    b.op("w0", "info", ["w0-2"])
    b.op("w0", "ok", ["w0-2"], (NEW, 0))
    unplaced = unplaced_appends(b.ops)
    assert unplaced == {digest(b"w0-2")}
    read = [(f"{OLD}:0", b"w0-1"), (f"{NEW}:0", b"w0-2")]
    ops = as_ledger_history(b.ops, read, {OLD})
    view = Observation.of("r0", "CLOSED", 0, [(0, b"w0-1")])
    view.past_end.append((1, "n1", digest(b"w0-2")))
    assert check(ops, {OLD: [view]}, unplaced).ok
    view.past_end.append((2, "n1", digest(b"w0-1")))
    assert check(ops, {OLD: [view]}, unplaced).kinds() == {"past_end"}


def entries(read: list[tuple[str, bytes]], *indexes: int) -> list[tuple[str, str]]:
    """The read-back's entries at ``indexes``, as a read during the run got them."""
    return [(read[i][0], read[i][1].decode()) for i in indexes]


def test_readers_that_agree_with_the_stream_are_clean() -> None:
    """After the appends: a cursor reads, acknowledges, reads again without an ack (the same
    entries again), is reset back and reads there, acknowledges with an unknown outcome (the
    next read may begin at either place); a plain reader reads from the start and on from
    where it stopped, across the takeover's new ledger; a read of an empty stream invoked
    before any append was acknowledged got nothing: clean."""
    b, read = clean()
    early = Builder()
    early.read("r1", [], "stream_read")
    b.ops[:0] = early.ops  # before the first append
    b.t += early.t
    b.call("c0", "cursor_create")
    b.read("c0", entries(read, 0, 1))
    b.call("c0", "cursor_ack", f"{OLD}:1")
    b.read("c0", entries(read, 2, 3))
    b.read("c0", entries(read, 2, 3))
    b.call("c0", "cursor_reset", f"{OLD}:1")
    b.read("c0", entries(read, 1, 2))
    b.call("c0", "cursor_ack", f"{OLD}:2", outcome="info")
    b.read("c0", entries(read, 1, 2))
    b.read("c0", entries(read, 3, 4))
    b.read("r0", entries(read, 0, 1), "stream_read")
    b.read("r0", entries(read, 2, 3, 4, 5, 6), "stream_read", f"{OLD}:2", limit=5)
    b.read("r0", entries(read, 6, 7, 8), "stream_read", f"{OLD}:6", limit=5)  # to the end
    verdict = check_stream(b.ops, read)
    assert verdict.ok, verdict
    assert (verdict.counts["reads"], verdict.counts["read_entries"]) == (10, 22)


def test_a_read_of_other_bytes_than_the_stream_holds() -> None:
    b, read = clean()
    b.read("r0", [(f"{OLD}:0", "w0-1"), (f"{OLD}:1", "w0-1")], "stream_read")
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"read_mismatch"}
    assert {(v.ledger, v.entry) for v in verdict.violations} == {(OLD, 1)}
    assert any("was acknowledged" in v.detail for v in verdict.violations)


def test_a_read_of_an_entry_the_stream_does_not_keep() -> None:
    """A reader got w2-3 (unknown outcome) at NEW:3; the stream ends at NEW:2."""
    b, read = clean()
    b.read("r0", [(f"{NEW}:3", "w2-3")], "stream_read", f"{NEW}:3")
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"dirty_read"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(NEW, 3)]


def test_a_read_of_bytes_no_append_carried() -> None:
    b, read = clean()
    b.read("r0", [(f"{NEW}:3", "ghost")], "stream_read", f"{NEW}:3")
    assert kinds(b.ops, read) == {"phantom", "dirty_read"}


def test_a_read_that_passes_over_an_entry() -> None:
    b, read = clean()
    b.read("r0", entries(read, 0, 2), "stream_read")
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"skip"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(OLD, 1)]


def test_a_plain_read_that_begins_past_its_from() -> None:
    b, read = clean()
    b.read("r0", entries(read, 3, 4), "stream_read", f"{OLD}:2")
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"skip"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(OLD, 2)]


def test_entries_of_a_read_out_of_order() -> None:
    b, read = clean()
    b.read("r0", entries(read, 1, 0), "stream_read")
    assert "order" in kinds(b.ops, read)


def test_a_cursor_that_skips_entries_between_two_reads() -> None:
    b, read = clean()
    b.call("c0", "cursor_create")
    b.read("c0", entries(read, 0, 1))
    b.call("c0", "cursor_ack", f"{OLD}:1")
    b.read("c0", entries(read, 3, 4))  # OLD:2 passed over
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"skip"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(OLD, 2)]


def test_a_cursor_that_returns_an_acknowledged_entry_again() -> None:
    b, read = clean()
    b.call("c0", "cursor_create")
    b.read("c0", entries(read, 0, 1))
    b.call("c0", "cursor_ack", f"{OLD}:1")
    b.read("c0", entries(read, 1, 2))
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"read_twice"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(OLD, 1)]


def test_a_read_that_misses_entries_acknowledged_before_it_began() -> None:
    """Every append was acknowledged: a cursor's first read finds nothing, a plain read from
    OLD:4 gets two entries of the five it asked for (NEW:0 and NEW:1 were acknowledged)."""
    b, read = clean()
    b.call("c0", "cursor_create")
    b.read("c0", [])
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"stale_read"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(OLD, 0)]
    b, read = clean()
    b.read("r0", entries(read, 4, 5), "stream_read", f"{OLD}:4", limit=5)
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"stale_read"}
    assert [(v.ledger, v.entry) for v in verdict.violations] == [(NEW, 0)]


def test_the_stream_reads_as_the_ledger_checkers_reads() -> None:
    """Entries a stream reader got become reads of their ledgers: one past the closed
    ledger's end is a dirty read there too, of bytes the ledger does not hold."""
    b, read = clean()
    b.read("r0", [(f"{OLD}:6", "w2-3")], "stream_read", f"{OLD}:6")
    ops = as_ledger_history(b.ops, read, {OLD})
    assert [(op.f, op.entry) for op in ops if op.p == "r0"] == [("read", 6)]
    held = [(int(p.split(":")[1]), payload) for p, payload in read if p.startswith(f"{OLD}:")]
    assert check(ops, {OLD: [Observation.of("r0", "CLOSED", 5, held)]}).kinds() == {
        "dirty_read",
        "phantom",
    }


def test_an_ack_of_unknown_outcome_may_land_after_a_later_reset() -> None:
    """Seen in a fault round: an ack sent to a paused owner timed out; much later the cursor
    was reset (ok) to an earlier entry, and the next read began after the timed-out ack's
    entry: that ack landed after the reset. Legal: its outcome was unknown. A read that
    begins past both is still a skip."""
    b, read = clean()
    b.call("c0", "cursor_create")
    b.read("c0", entries(read, 0, 1))
    b.call("c0", "cursor_ack", f"{OLD}:3", outcome="info")
    b.call("c0", "cursor_ack", f"{OLD}:4")
    b.call("c0", "cursor_reset", f"{OLD}:0")
    b.read("c0", entries(read, 4, 5))  # after OLD:3: the late ack
    assert check_stream(b.ops, read).ok
    b.read("c0", entries(read, 7, 8))  # after OLD:3 or at OLD:0, never at NEW:1
    verdict = check_stream(b.ops, read)
    assert verdict.kinds() == {"skip"}
