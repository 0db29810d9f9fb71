"""The CAS loop's answer to a lost reply or a store that does not answer: re-read, re-check,
never apply twice."""

from __future__ import annotations

import asyncio
import json

import pytest

from node.client.errors import NoSuchKey, OutcomeUnknown, StoreUnavailable
from node.client.metadata.etcd import DEFAULT_TIMEOUT_S, EtcdStore
from node.client.metadata.loop import update
from node.client.metadata.memory import MemoryStore
from node.client.metadata.store import Versioned
from tests.harness.etcd import EtcdServer


class LosesAnswers(MemoryStore):
    """The in-memory store whose next cas replies are lost: ``applied`` ones after the change
    went in (etcd applied the txn, the connection died), ``unsent`` ones before."""

    def __init__(self, applied: int = 0, unsent: int = 0) -> None:
        super().__init__()
        self.applied, self.unsent = applied, unsent

    async def cas(self, key: str, value: bytes, revision: int) -> Versioned:
        if self.unsent:
            self.unsent -= 1
            raise StoreUnavailable("no endpoint answers")
        done = await super().cas(key, value, revision)
        if self.applied:
            self.applied -= 1
            raise OutcomeUnknown("the answer was lost")
        return done


def needs(raw: bytes) -> bool:
    return "me" not in json.loads(raw)["by"]


def join(raw: bytes) -> bytes:
    doc = json.loads(raw)
    return json.dumps({"n": doc["n"] + 1, "by": [*doc["by"], "me"]}).encode()


async def test_a_lost_answer_of_an_applied_change_is_done_not_repeated() -> None:
    store = LosesAnswers(applied=1)
    first = await store.create("k", json.dumps({"n": 0, "by": []}).encode())
    done = await update(store, "k", first, needs, join, pause_s=0)
    assert json.loads(done.value) == {"n": 1, "by": ["me"]}
    assert await store.get("k") == done


async def test_an_unavailable_store_is_waited_out_then_the_change_applies() -> None:
    store = LosesAnswers(unsent=3)
    first = await store.create("k", json.dumps({"n": 0, "by": []}).encode())
    done = await update(store, "k", first, needs, join, pause_s=0)
    assert json.loads(done.value) == {"n": 1, "by": ["me"]}


async def test_the_retries_are_bounded() -> None:
    store = LosesAnswers(unsent=5)
    first = await store.create("k", json.dumps({"n": 0, "by": []}).encode())
    with pytest.raises(StoreUnavailable):
        await update(store, "k", first, needs, join, attempts=3, pause_s=0)


async def test_a_deleted_key_is_no_such_key() -> None:
    store = MemoryStore()
    first = await store.create("k", json.dumps({"n": 0, "by": []}).encode())
    await store.delete("k", first.revision)
    with pytest.raises(NoSuchKey):
        await update(store, "k", first, needs, join, pause_s=0)


# --- against a real etcd that stops or dies mid-update ----------------------------------------

# longer than the store's timeout, so the cas in flight loses its answer
PAUSE_S = DEFAULT_TIMEOUT_S + 1.0
DOWN_S = 2.0


async def test_a_change_sent_to_a_stopped_etcd_is_found_applied_not_repeated(
    own_etcd: EtcdServer,
) -> None:
    """The cas reaches a SIGSTOPped etcd and times out (OutcomeUnknown); etcd resumes and applies
    it; the loop re-reads, finds its change in and stops there."""
    store = EtcdStore(own_etcd.url("loop-paused"))
    try:
        first = await store.create("k", json.dumps({"n": 0, "by": []}).encode())
        own_etcd.pause()
        resumed = asyncio.get_running_loop().call_later(PAUSE_S, own_etcd.resume)
        try:
            done = await update(store, "k", first, needs, join)
        finally:
            resumed.cancel()
            own_etcd.resume()
        assert json.loads(done.value) == {"n": 1, "by": ["me"]}
        assert await store.get("k") == done
    finally:
        await store.close()


async def test_an_update_waits_out_an_etcd_restart(own_etcd: EtcdServer) -> None:
    store = EtcdStore(own_etcd.url("loop-restart"))
    try:
        first = await store.create("k", json.dumps({"n": 0, "by": []}).encode())
        await asyncio.to_thread(own_etcd.kill)
        updating = asyncio.create_task(update(store, "k", first, needs, join))
        await asyncio.sleep(DOWN_S)
        assert not updating.done()
        await asyncio.to_thread(own_etcd.start)
        done = await updating
        assert json.loads(done.value) == {"n": 1, "by": ["me"]}
    finally:
        await store.close()
