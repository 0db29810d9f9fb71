"""The checker against crafted histories and ledgers: a clean run passes, and each way a
ledger can contradict its history is caught and named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.jepsen.checker import Observation, check
from node.jepsen.history import ABSENT, History, Op, digest, load, read_ops

LEDGER = 1 << 62


def payload(i: int) -> bytes:
    return f"w0-{i}".encode()


def clean_history() -> History:
    """w0 adds 0..2 (ok), a batch 3..4 (ok), an add whose outcome is unknown (info: it landed
    at 5), an add that failed, then closes at 5."""
    h = History("w0")
    for i in range(3):
        h.log("invoke", "add", LEDGER, None, digest(payload(i)))
        h.log("ok", "add", LEDGER, i, digest(payload(i)))
    batch = [digest(payload(3)), digest(payload(4))]
    h.log("invoke", "add_batch", LEDGER, None, batch)
    h.log("ok", "add_batch", LEDGER, 3, batch)
    h.log("invoke", "add", LEDGER, None, digest(payload(5)))
    h.log("info", "add", LEDGER, None, digest(payload(5)))
    h.log("invoke", "add", LEDGER, None, digest(payload(99)))
    h.log("fail", "add", LEDGER, None, digest(payload(99)))
    h.log("ok", "read", LEDGER, 1, digest(payload(1)))
    h.log("invoke", "recover", LEDGER)
    h.log("ok", "recover", LEDGER, 5)
    return h


def view(name: str = "r0", last: int = 5, ids: list[int] | None = None) -> Observation:
    ids = list(range(last + 1)) if ids is None else ids
    return Observation.of(name, "CLOSED", last, [(i, payload(i)) for i in ids])


def test_a_clean_run_is_clean() -> None:
    verdict = check(clean_history().ops, {LEDGER: [view("r0"), view("r1"), view("r2")]})
    assert verdict.ok, verdict
    assert verdict.counts == {
        "ok": 5,
        "info": 1,
        "fail": 1,
        "unfinished": 0,
        "ledgers": 1,
        "reads": 1,
        "reads_ok": 1,
        "read_entries": 1,
    }


def test_info_may_be_absent() -> None:
    """The unknown add at 5 did not land: the recovery closed at 4; still clean."""
    ops = [op for op in clean_history().ops if not (op.f == "recover" and op.type == "ok")]
    ops.append(Op("r", "ok", "recover", LEDGER, 4))
    assert check(ops, {LEDGER: [view(last=4)]}).ok


def test_a_lost_acknowledged_entry_is_caught() -> None:
    """The ledger was closed before an acknowledged entry (BookKeeper #2614's outcome)."""
    ops = [op for op in clean_history().ops if op.f != "recover"]
    verdict = check(ops, {LEDGER: [view(last=1)]})
    assert verdict.kinds() == {"short"}
    assert sorted(v.entry for v in verdict.violations) == [2, 3, 4]


def test_other_bytes_at_an_acknowledged_id_are_lost() -> None:
    bad = view()
    bad.entries[2] = (2, digest(b"something else"))
    verdict = check(clean_history().ops, {LEDGER: [view("r0"), bad]})
    assert {"lost", "phantom"} <= verdict.kinds()
    assert {v.entry for v in verdict.violations if v.kind == "lost"} == {2}


def test_readers_that_disagree_on_the_end() -> None:
    verdict = check(clean_history().ops, {LEDGER: [view("r0", 5), view("r1", 4)]})
    assert "disagree" in verdict.kinds()


def test_a_close_elsewhere_than_the_readers_see() -> None:
    verdict = check(clean_history().ops, {LEDGER: [view(last=4)]})
    assert "disagree" in verdict.kinds()  # the recovery said 5


def test_what_a_replica_serves_past_the_end() -> None:
    """An acknowledged add's bytes past the end are past_end (and the ledger is short); a
    failed add's are failed_present; bytes nobody wrote are phantoms; an unknown add's bytes
    are a leftover the recovery did not find: counted, no violation."""
    ops = clean_history().ops
    for served, kind in ((payload(4), "past_end"), (payload(99), "failed_present")):
        bad = view()
        bad.past_end.append((6, "n1", digest(served)))
        assert check(ops, {LEDGER: [bad]}).kinds() == {kind}
    ghost = view()
    ghost.past_end.append((6, "n1", digest(b"ghost")))
    assert check(ops, {LEDGER: [ghost]}).kinds() == {"phantom"}
    unknown = [op for op in ops if op.f != "recover"] + [Op("r", "ok", "recover", LEDGER, 4)]
    leftover = view(last=4)
    leftover.past_end.append((5, "n2", digest(payload(5))))
    verdict = check(unknown, {LEDGER: [leftover]})
    assert verdict.ok, verdict
    assert verdict.counts["leftovers"] == 1


def test_a_gap() -> None:
    verdict = check(clean_history().ops, {LEDGER: [view(ids=[0, 1, 2, 3, 5])]})
    assert verdict.kinds() == {"gap", "lost"}  # 4 was acknowledged, too
    assert {v.entry for v in verdict.violations} == {4}


def test_entries_out_of_order() -> None:
    verdict = check(clean_history().ops, {LEDGER: [view(ids=[0, 2, 1, 3, 4, 5])]})
    assert verdict.kinds() == {"order"}


def test_a_failed_add_that_is_there() -> None:
    bad = Observation.of(
        "r0", "CLOSED", 6, [(i, payload(i)) for i in range(6)] + [(6, payload(99))]
    )
    ops = [op for op in clean_history().ops if op.f != "recover"]
    assert check(ops, {LEDGER: [bad]}).kinds() == {"failed_present"}


def test_bytes_no_add_wrote() -> None:
    bad = Observation.of("r0", "CLOSED", 6, [(i, payload(i)) for i in range(6)] + [(6, b"ghost")])
    ops = [op for op in clean_history().ops if op.f != "recover"]
    assert check(ops, {LEDGER: [bad]}).kinds() == {"phantom"}


def test_a_read_during_the_run_that_the_ledger_contradicts() -> None:
    h = clean_history()
    h.log("ok", "read", LEDGER, 2, digest(payload(1)))  # read 2, got 1's bytes
    assert check(h.ops, {LEDGER: [view()]}).kinds() == {"read_mismatch"}


def test_a_ledger_not_closed() -> None:
    bad = view()
    bad.state = "IN_RECOVERY"
    assert check(clean_history().ops, {LEDGER: [bad]}).kinds() == {"not_closed"}


def test_a_ledger_nobody_could_read() -> None:
    assert check(clean_history().ops, {}).kinds() == {"unreadable"}
    failed = Observation("r0", error="RecoveryFailed: no quorum")
    verdict = check(clean_history().ops, {LEDGER: [failed, view("r1")]})
    assert verdict.kinds() == {"unreadable"}
    assert "no quorum" in str(verdict)


def test_history_files_of_several_processes_merge_and_a_torn_line_is_a_kill(
    tmp_path: Path,
) -> None:
    writer = History("w0", tmp_path / "w0.jsonl")
    writer.log("invoke", "add", LEDGER, None, "d0")
    writer.log("ok", "add", LEDGER, 0, "d0")
    writer.close()
    with (tmp_path / "w0.jsonl").open("a") as f:
        f.write('{"p":"w0","type":"inv')  # SIGKILL in the middle of a line
    recoverer = History("r0")
    recoverer.log("ok", "recover", LEDGER, 0)
    recoverer.dump(tmp_path / "r0.jsonl")
    ops = load([tmp_path / "w0.jsonl", tmp_path / "r0.jsonl"])
    assert [(op.p, op.type, op.f) for op in ops] == [
        ("w0", "invoke", "add"),
        ("w0", "ok", "add"),
        ("r0", "ok", "recover"),
    ]
    (tmp_path / "bad.jsonl").write_text('{"p":"w0","ty\n{"p":"w0"}\n')
    with pytest.raises(ValueError):
        list(read_ops(tmp_path / "bad.jsonl"))


def test_an_add_whose_process_died_is_unfinished_and_may_be_there() -> None:
    h = clean_history()
    h.log("invoke", "add", LEDGER, None, digest(payload(6)))  # killed before the answer
    ops = [op for op in h.ops if op.f != "recover"]
    verdict = check(ops, {LEDGER: [view(last=6, ids=list(range(7)))]})
    assert verdict.ok, verdict
    assert verdict.counts["unfinished"] == 1


def test_two_acknowledged_adds_at_one_id() -> None:
    h = clean_history()
    h.log("ok", "add", LEDGER, 2, digest(b"other"))
    assert "twice" in check(h.ops, {LEDGER: [view()]}).kinds()


def reading(h: History, first: int, got: list[bytes], last: int | None = None, **end: Any) -> None:
    """Reader rd0 reads ``first``..``last`` and gets ``got`` (``end``: how the read ended
    when not ok, e.g. type="fail", error=ABSENT)."""
    last = first + len(got) - 1 if last is None else last
    kind = end.pop("type", "ok")
    reader = History("rd0")
    reader.ops = h.ops  # one list: the operations stay in time order
    reader.log("invoke", "read", LEDGER, first, last=last)
    reader.log(kind, "read", LEDGER, first, [digest(p) for p in got], last=last, **end)


def test_reads_during_the_run_that_agree_are_clean() -> None:
    """Entries read while the writer wrote, a LAC it was told, a read that ended early
    without saying why (info), the closed ledger's end read by the reader: clean."""
    h = clean_history()
    h.log("invoke", "read_lac", LEDGER)
    h.log("ok", "read_lac", LEDGER, 4)
    reading(h, 0, [payload(i) for i in range(5)])
    reading(h, 2, [payload(2)], last=4, type="info", error="ReadFailed: timeout")
    h.log("invoke", "read_lac", LEDGER)
    h.log("ok", "read_lac", LEDGER, 5, last=5)
    verdict = check(h.ops, {LEDGER: [view()]})
    assert verdict.ok, verdict
    assert (verdict.counts["reads"], verdict.counts["read_entries"]) == (5, 7)


def test_a_read_that_got_other_bytes_than_acknowledged() -> None:
    """The ledger holds the acknowledged bytes; a reader was served others at that id (a
    replica with an older copy, say): caught though the final state is right."""
    h = clean_history()
    other = History("w1")
    other.log("invoke", "add", LEDGER, None, digest(b"w1-1"))
    other.log("info", "add", LEDGER, None, digest(b"w1-1"))
    h.ops += other.ops
    reading(h, 1, [payload(1), b"w1-1"])
    verdict = check(h.ops, {LEDGER: [view()]})
    assert verdict.kinds() == {"read_mismatch"}
    assert [v.entry for v in verdict.violations] == [2, 2]  # against the ack and the final
    assert any("was acknowledged" in v.detail for v in verdict.violations)


def test_a_read_of_an_entry_the_ledger_does_not_keep() -> None:
    """A reader got entry 5 (the unknown add's bytes), then the recovery closed at 4: it saw
    an entry the ledger does not keep (a dirty read), even though no reader finds it now."""
    ops = [op for op in clean_history().ops if op.f != "recover"]
    h = History("w0")
    h.ops = [*ops, Op("r", "ok", "recover", LEDGER, 4)]
    reading(h, 4, [payload(4), payload(5)])
    verdict = check(h.ops, {LEDGER: [view(last=4)]})
    assert verdict.kinds() == {"dirty_read"}
    assert [v.entry for v in verdict.violations] == [5]


def test_a_lac_past_the_final_end() -> None:
    h = clean_history()
    h.log("ok", "read_lac", LEDGER, 7)
    verdict = check(h.ops, {LEDGER: [view()]})
    assert verdict.kinds() == {"dirty_read"}
    assert "told LAC 7" in str(verdict)


def test_a_reader_told_another_end_of_the_closed_ledger() -> None:
    h = clean_history()
    h.log("ok", "read_lac", LEDGER, 3, last=3)
    assert check(h.ops, {LEDGER: [view()]}).kinds() == {"disagree"}


def test_a_read_of_bytes_no_add_wrote() -> None:
    h = clean_history()
    reading(h, 0, [b"ghost"])
    assert "phantom" in check(h.ops, {LEDGER: [view()]}).kinds()


def test_an_acknowledged_entry_absent_from_a_later_read() -> None:
    """Entries 0..1 came back, then every replica of 2's write set said "no such entry", to a
    read invoked after 2 was acknowledged: a stale read. The same answer to a read invoked
    before the add's ok is not (the add may not have landed yet)."""
    h = clean_history()
    reading(h, 0, [payload(0), payload(1)], last=4, type="fail", error=ABSENT)
    verdict = check(h.ops, {LEDGER: [view()]})
    assert verdict.kinds() == {"stale_read"}
    assert [v.entry for v in verdict.violations] == [2]

    early = History("rd0")
    early.log("invoke", "read", LEDGER, 0, last=0)
    ops = clean_history().ops
    ops.insert(0, early.ops[0])  # invoked before the first add was acknowledged
    ops.append(Op("rd0", "fail", "read", LEDGER, 0, [], ops[-1].t + 1, 0, ABSENT))
    assert check(ops, {LEDGER: [view()]}).ok
