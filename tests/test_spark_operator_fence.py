"""The driver's fence: it HEADs every reported delta, and a daemon on the driver's host is asked to
answer once its deltas are durable (AWAIT_DURABLE), which wakes the fence for its HEADs at once
instead of at its next poll. The HEADs decide: a daemon that cannot be asked leaves the polling."""
from __future__ import annotations

import asyncio
import socket

import pytest

from statestore_async.client.clients import Client
from statestore_async.files.names import DELTA, file_key
from statestore_async.ids import StoreId
from statestore_async.spark import StatefulOperator
from statestore_async.spark.api.examples import CountSum
from statestore_async.spark.driver.driverio import durable_answers
from statestore_async.spark.shared.coordinator import local_socket, location_of

OUT = "key string, count bigint, sum bigint"


def test_local_socket_names_only_this_hosts_daemons():
    assert local_socket(location_of("/run/statestore/d.sock")) == "/run/statestore/d.sock"
    assert local_socket(f"another-{socket.gethostname()}:/run/statestore/d.sock") is None
    assert local_socket(None) is None and local_socket("no-colon") is None


def _commit(sock: str, root: str, partitions: range) -> dict:
    refs = {}
    with Client(sock) as c:
        for p in partitions:
            with c.open(StoreId(root, "fence", p), 0) as h:
                h.put_many([(b"\x00\x01key%d" % i, b"value") for i in range(2000)])
                refs[p] = h.commit()
    return refs


def test_the_answers_come_once_every_delta_is_in_the_object_store(daemon, tmp_path):
    root = f"file://{tmp_path}/s"
    refs = _commit(daemon.socket, root, range(3))
    wanted = [(StoreId(root, "fence", p), ref) for p, ref in refs.items()]
    asyncio.run(durable_answers(daemon.socket, wanted, 60))
    for sid, ref in wanted:
        assert (tmp_path / "s" / file_key(sid, ref, DELTA)).exists()


@pytest.mark.spark
def test_a_daemon_that_cannot_answer_leaves_the_fence_to_its_polling(spark, daemon, tmp_path):
    root = f"file://{tmp_path}/s"
    refs = _commit(daemon.socket, root, range(2))
    asyncio.run(durable_answers(str(tmp_path / "nobody.sock"), [(StoreId(root, "fence", 0), refs[0])], 60))
    op = StatefulOperator(root, "fence", ["key"], CountSum(), OUT, 2, 16, socket_path=daemon.socket)
    op._fence(refs, locations={0: location_of(str(tmp_path / "nobody.sock")), 1: location_of(daemon.socket)})
    for p, ref in refs.items():
        assert (tmp_path / "s" / file_key(StoreId(root, "fence", p), ref, DELTA)).exists()
    op.close()


@pytest.mark.spark
@pytest.mark.parametrize("materialize", ["checkpoint", "none"])
def test_batches_fence_with_their_daemons_answers(spark, daemon, tmp_path, materialize):
    root = f"file://{tmp_path}/s"
    op = StatefulOperator(root, "hint", ["key"], CountSum(), OUT, 2, 16, socket_path=daemon.socket,
                          materialize=materialize)
    for b in range(2):
        df = spark.createDataFrame([(f"k{i % 9}", i) for i in range(90)], "key string, value bigint")
        prog = op.process_batch(df, b, lambda df, b: df.collect())
        assert {local_socket(loc) for loc in prog.locations.values()} == {daemon.socket}
        for p, ref in prog.refs.items():
            assert (tmp_path / "s" / file_key(StoreId(root, "hint", p), ref, DELTA)).exists()
