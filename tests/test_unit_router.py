"""Unit tests of supervisor/routing/router.py against FakeRouterHost: an implementation of the router's
``RouterHost`` protocol with a fake clock, real Timers, real ModelPools (on the pool tests'
FakeHost, no processes), real ZeroMQ sockets over ``inproc://`` (a client DEALER talks to a
frontend ROUTER) and a real link per fake worker (shared/link.py, over a socket pair), so every
message the router sends is read back and checked as bytes.
"""

from __future__ import annotations

import collections
import itertools
import select
import socket
import time

import msgpack
import pytest
import zmq

from modelwarden.shared import protocol
from modelwarden.shared.config import DaemonConfig, Settings
from modelwarden.shared.link import Link
from modelwarden.shared.protocol import SIGNATURE
from modelwarden.shared.sockets import recv_parts
from modelwarden.supervisor.routing.buffers import BufferRegistry
from modelwarden.supervisor.routing.quotas import Quotas, Shares, shares_from
from modelwarden.supervisor.routing.router import Router, RouterHost
from tests.test_unit_pool import FakeHost, exit_with, make_pool, ready

_ports = itertools.count()


class FakeRouterHost(FakeHost):
    """A RouterHost and the PoolHost of its pools at once, as the Arbiter is."""

    def __init__(self, context: zmq.Context) -> None:
        super().__init__()
        self.settings = Settings(daemon=DaemonConfig())
        self.pools: dict = {}
        self.registry = BufferRegistry()
        self.quotas = Quotas(shares_from(self.settings, 64, 64), house="-")  # requests here have no identity
        name = f"inproc://router-test-{next(_ports)}"
        self.frontend = context.socket(zmq.ROUTER)
        self.frontend.bind(name + "-frontend")
        self.client = context.socket(zmq.DEALER)
        self.client.connect(name + "-frontend")
        self.context = context
        self.router: Router | None = None
        self.worker_ends: dict = {}

    def shm_offered(self, frontend: int) -> bool:
        return False

    def launch(self, spec, on_state):
        """A fake worker, on a real link: the router's end is the handle's, the worker's end
        is ``worker_ends[handle]``."""
        handle = super().launch(spec, on_state)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        handle.link = Link(ours)
        self.worker_ends[handle] = Link(theirs)
        return handle

    def recover_requests(self, pool, handle) -> None:
        if self.router is None:
            super().recover_requests(pool, handle)
        else:
            self.router.recover(pool, handle)

    def on_worker_ready(self, pool) -> None:
        super().on_worker_ready(pool)
        if self.router is not None:
            self.router.dispatch(pool)


class Harness:
    """The router, its host, one pool of ``workers`` READY fake workers, each on its own link
    (the fake worker's end: ``workers[handle]``)."""

    def __init__(self, context: zmq.Context, workers: int = 1, **model) -> None:
        self.host = FakeRouterHost(context)
        self.router = self.host.router = Router(self.host)
        # One request per worker at a time unless a test says otherwise: most tests here are
        # about when requests queue, which is plainest at one.
        model.setdefault("max_inflight", 1)
        self.pool = make_pool(self.host, workers=workers, **model)
        self.host.pools[self.pool.name] = self.pool
        self.pool.start_all()
        for handle in self.host.launched:
            ready(self.pool, handle)
        self.workers = self.host.worker_ends
        self._received: dict = collections.defaultdict(collections.deque)
        self._ids = itertools.count(1)
        self.sent: dict[int, list] = {}

    @property
    def handles(self):
        return self.host.launched

    def send(self, rows: int = 1, timeout_ms: int | None = None, width: int = 8,
             identity: str = "-", round_ends: bool = True) -> int:
        """A client request, as the arbiter hands it to the router; returns its client id.
        ``round_ends``: the loop's poll round ends after it (``dispatch_wanted``)."""
        client_id = next(self._ids)
        header = {"type": "infer", "id": client_id, "model": self.pool.name, "inputs": 0,
                  "tensors": [{"dtype": "float32", "shape": [rows, width], "frame": 0}]}
        if timeout_ms is not None:
            header["timeout_ms"] = timeout_ms
        payload = bytes(range(256)) * (rows * width * 4 // 256) + bytes(rows * width * 4 % 256)
        self.host.client.send_multipart([SIGNATURE, protocol.pack(header), payload])
        frames = recv_parts(self.host.frontend)
        envelope = protocol.split_router_message(frames)
        self.router.accept_infer(self.host.frontend, (0, frames[0].bytes), envelope,
                                 protocol.unpack_header(envelope.header.buffer), identity)
        if round_ends:
            self.router.dispatch_wanted()
        self.sent[client_id] = [protocol.pack(header), payload]
        return client_id

    def worker_receives(self, handle, timeout_ms: int = 1000) -> tuple[dict, list[bytes]]:
        assert self._wait(handle, timeout_ms), f"{handle.worker_id} got nothing"
        frames = self._received[handle].popleft()
        return msgpack.unpackb(frames[0]), frames[1:]

    def worker_idle(self, handle) -> bool:
        return not self._wait(handle, 50)

    def _wait(self, handle, timeout_ms: int) -> bool:
        """Whether a message came to ``handle``'s fake worker within ``timeout_ms``."""
        received, end = self._received[handle], self.workers[handle]
        deadline = time.monotonic() + timeout_ms / 1000
        while not received:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([end.fd], [], [], left)[0]:
                return False
            received.extend(end.receive())
        return True

    def answer(self, handle, rid: int, client_id, ok: bool = True, batch: int = 1) -> None:
        """The worker's result, as the arbiter hands it to the router."""
        reply = ({"id": client_id, "ok": True, "outputs": 0,
                  "tensors": [{"dtype": "float32", "shape": [1], "frame": 0}],
                  "worker": handle.worker_id} if ok else
                 {**protocol.error_header(client_id, "MODEL_ERROR", "boom"),
                  "worker": handle.worker_id})
        envelope = {"type": protocol.RESULT, "rid": rid, "ok": ok, "compute_us": 5, "batch": batch}
        frames = [protocol.pack(reply)] + ([b"\0" * 4] if ok else [])  # as a link delivers them
        self.router.on_result(self.pool, handle, envelope, frames)
        self.router.dispatch_wanted()

    def client_receives(self, timeout_ms: int = 1000) -> tuple[dict, list[bytes]]:
        assert self.host.client.poll(timeout_ms), "the client got no answer"
        frames = self.host.client.recv_multipart()
        assert frames[0] == SIGNATURE
        return msgpack.unpackb(frames[1]), frames[2:]

    def client_idle(self) -> bool:
        return not self.host.client.poll(50)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_the_host_fake_is_a_router_host(context):
    assert isinstance(FakeRouterHost(context), RouterHost)
    _: RouterHost = FakeRouterHost(context)


def test_a_request_goes_to_a_free_worker_unchanged_and_gets_one_answer(context):
    rig = Harness(context)
    worker = rig.handles[0]
    client_id = rig.send()
    envelope, frames = rig.worker_receives(worker)
    assert envelope["type"] == protocol.RUN
    assert frames == rig.sent[client_id]  # the client's header and payload, as they came
    rig.answer(worker, envelope["rid"], client_id)
    header, payload = rig.client_receives()
    assert header["id"] == client_id and header["ok"] and header["worker"] == worker.worker_id
    assert set(header["timing"]) == {"queue_us", "compute_us", "total_us", "batch"}
    assert header["timing"]["compute_us"] == 5 and payload == [b"\0" * 4]
    rig.answer(worker, envelope["rid"], client_id)  # a second answer for the same rid
    assert rig.client_idle()
    assert not rig.router.pending and not worker.inflight


def test_requests_queue_while_every_worker_is_busy_and_go_when_one_frees(context):
    rig = Harness(context)
    worker = rig.handles[0]
    first = rig.send()
    second = rig.send()
    run, _ = rig.worker_receives(worker)
    assert rig.worker_idle(worker) and rig.router.queued(rig.pool) == 1
    rig.answer(worker, run["rid"], first)
    nxt, frames = rig.worker_receives(worker)
    assert nxt["type"] == protocol.RUN and frames == rig.sent[second]
    assert rig.router.queued(rig.pool) == 0


def test_queued_compatible_requests_go_as_one_batch_message(context):
    rig = Harness(context, batching={"max_size": 8})
    worker = rig.handles[0]
    busy = rig.send()
    run, _ = rig.worker_receives(worker)
    queued = [rig.send(rows=rows) for rows in (1, 2, 3)]
    odd = rig.send(width=4)  # another non-batch dimension: never merged
    rig.answer(worker, run["rid"], busy)
    rig.client_receives()
    batch, frames = rig.worker_receives(worker)
    assert batch["type"] == protocol.BATCH and batch["frames"] == [2, 2, 2]
    assert frames == [part for client_id in queued for part in rig.sent[client_id]]
    for rid, client_id in zip(batch["rids"], queued):
        rig.answer(worker, rid, client_id, batch=3)
        header, _ = rig.client_receives()
        assert header["id"] == client_id and header["timing"]["batch"] == 3
    alone, frames = rig.worker_receives(worker)
    assert alone["type"] == protocol.RUN and frames == rig.sent[odd]
    assert rig.router.services[rig.pool.name].batches.view()["histogram"] == {"1": 2, "3": 1}


def test_a_partial_batch_is_held_until_max_delay_after_its_head_arrived(context):
    rig = Harness(context, batching={"max_size": 8, "max_delay_us": 2000})
    worker = rig.handles[0]
    busy = rig.send()
    run, _ = rig.worker_receives(worker)
    held = rig.send()
    rig.answer(worker, run["rid"], busy)
    rig.client_receives()
    assert rig.worker_idle(worker)  # the worker is free, but the partial batch waits
    rig.host.advance(0.001)
    later = rig.send()
    assert rig.worker_idle(worker)
    rig.host.advance(0.0011)  # 2.1 ms after the head arrived
    batch, frames = rig.worker_receives(worker)
    assert batch["type"] == protocol.BATCH and len(batch["rids"]) == 2
    assert frames == rig.sent[held] + rig.sent[later]


def test_a_lone_request_on_an_idle_pool_is_never_held(context):
    rig = Harness(context, batching={"max_size": 8, "max_delay_us": 10_000_000})
    rig.send()
    run, _ = rig.worker_receives(rig.handles[0])
    assert run["type"] == protocol.RUN


def test_requests_arriving_in_one_round_go_to_a_free_worker_as_one_batch(context):
    rig = Harness(context, workers=2, batching={"max_size": 8})
    first, second = rig.handles
    rig.send(round_ends=False)
    rig.send(round_ends=False)  # both workers free: one by one, each would go alone
    assert rig.worker_idle(first) and rig.worker_idle(second)  # not before the round ends
    rig.router.dispatch_wanted()
    sent = [rig.worker_receives(handle)[0] for handle in rig.handles if not rig.worker_idle(handle)]
    assert [(m["type"], len(m["rids"])) for m in sent] == [(protocol.BATCH, 2)]


def test_a_run_and_a_batch_carry_each_requests_deadline_in_microseconds(context):
    rig = Harness(context, workers=1, max_inflight=1, batching={"max_size": 8})
    worker = rig.handles[0]
    start = rig.host.now
    rig.send(timeout_ms=1500)
    run, _ = rig.worker_receives(worker)
    assert run["type"] == protocol.RUN and run["until"] == int((start + 1.5) * 1_000_000)
    rig.send(timeout_ms=2000)  # queued behind the first: the two below join it in a batch
    rig.send(timeout_ms=3000)
    rig.answer(worker, run["rid"], None)
    batch, _ = rig.worker_receives(worker)
    assert batch["type"] == protocol.BATCH
    assert batch["until"] == [int((start + 2.0) * 1_000_000), int((start + 3.0) * 1_000_000)]


def test_a_timeout_from_a_worker_is_answered_as_the_daemons_own_timeout(context):
    rig = Harness(context)
    worker = rig.handles[0]
    client_id = rig.send(timeout_ms=1000)
    run, _ = rig.worker_receives(worker)
    reply = {**protocol.error_header(client_id, protocol.TIMEOUT, "past"), "worker": worker.worker_id}
    rig.router.on_result(rig.pool, worker, {"type": protocol.RESULT, "rid": run["rid"], "ok": False,
                                            "code": protocol.TIMEOUT}, [protocol.pack(reply)])
    header, _ = rig.client_receives()
    assert header["id"] == client_id and header["error"]["code"] == protocol.TIMEOUT
    assert "worker" not in header and worker.worker_id in header["error"]["message"]
    assert worker.errors == 0 and not rig.router.pending
    rig.host.advance(1.5)  # its deadline timer finds it answered: nothing more is sent
    assert rig.client_idle()


def test_a_deadline_answers_timeout_once_and_a_late_result_is_dropped(context):
    rig = Harness(context)
    worker = rig.handles[0]
    busy = rig.send(timeout_ms=1000)
    queued = rig.send(timeout_ms=500)
    run, _ = rig.worker_receives(worker)
    rig.host.advance(0.6)
    header, _ = rig.client_receives()
    assert header["id"] == queued and header["error"]["code"] == protocol.TIMEOUT
    assert "in the queue" in header["error"]["message"] and rig.router.queued(rig.pool) == 0
    rig.host.advance(0.5)
    header, _ = rig.client_receives()
    assert header["id"] == busy and header["error"]["code"] == protocol.TIMEOUT
    rig.answer(worker, run["rid"], busy)
    assert rig.client_idle() and not rig.router.pending


def test_a_full_queue_answers_overloaded_at_once(context):
    rig = Harness(context, max_queue=1)
    rig.send()
    rig.send()
    third = rig.send()
    header, _ = rig.client_receives()
    assert header["id"] == third and header["error"]["code"] == protocol.OVERLOADED


def test_a_dead_workers_batch_is_retried_one_per_forward_and_poison_ends_alone(context):
    rig = Harness(context, workers=2, batching={"max_size": 8})
    first, second = rig.handles
    busy = [rig.send(), rig.send()]
    runs = {h: rig.worker_receives(h)[0] for h in (first, second)}
    members = [rig.send() for _ in range(3)]
    rig.answer(first, runs[first]["rid"], busy[0])
    rig.client_receives()
    batch, _ = rig.worker_receives(first)
    assert batch["type"] == protocol.BATCH and len(batch["rids"]) == 3
    exit_with(rig.pool, first, -9)  # the worker dies holding the batch
    rig.router.dispatch_wanted()
    rig.answer(second, runs[second]["rid"], busy[1])
    rig.client_receives()
    retried, _ = rig.worker_receives(second)  # one request per forward from now on
    assert retried["type"] == protocol.RUN
    exit_with(rig.pool, second, -9)  # ... and it kills this worker too: poison
    header, _ = rig.client_receives()
    assert header["id"] == members[0] and header["error"]["code"] == protocol.POISON
    assert [request.client_id for request in rig.router.services[rig.pool.name].queue] == members[1:]
    assert all(request.alone for request in rig.router.services[rig.pool.name].queue)


def test_a_dead_worker_counts_its_death_against_its_first_request_only(context):
    rig = Harness(context, workers=2, max_inflight=2)
    first, second = rig.handles
    client_ids = [rig.send() for _ in range(4)]
    held = {handle: [rig.worker_receives(handle)[0]["rid"] for _ in range(2)]
            for handle in (first, second)}  # two in flight on each, in the order sent
    owner = {rid: client_id for client_id, rid in zip(client_ids, sorted(
        rid for rids in held.values() for rid in rids))}
    running, behind = held[first]
    exit_with(rig.pool, first, -9)  # only the first can have been running: the second waited
    rig.router.dispatch_wanted()
    queue = rig.router.services[rig.pool.name].queue
    assert [(r.rid, r.deaths, r.alone) for r in queue] == [(running, 1, False), (behind, 0, False)]
    for rid in held[second]:  # each answer frees room for one retry, in order
        rig.answer(second, rid, owner[rid])
        rig.client_receives()
    assert [rig.worker_receives(second)[0]["rid"] for _ in range(2)] == [running, behind]
    exit_with(rig.pool, second, -9)  # the first kills a second worker: poison; the other waited
    header, _ = rig.client_receives()
    assert header["id"] == owner[running] and header["error"]["code"] == protocol.POISON
    assert [(r.rid, r.deaths) for r in queue] == [(behind, 0)]


def test_requests_behind_a_probe_on_a_dead_worker_count_no_death(context):
    rig = Harness(context, max_inflight=2, probe={"interval": 1.0, "timeout": 2.0},
                  inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 8]}])
    worker = rig.handles[0]
    worker.probe.due_at = rig.host.now
    rig.router.send_due_probes(rig.pool, rig.pool.ready())
    assert rig.worker_receives(worker)[0].get("probe")
    rig.send()
    run, _ = rig.worker_receives(worker)  # behind the probe
    exit_with(rig.pool, worker, -9)  # the probe was running, not the request
    queue = rig.router.services[rig.pool.name].queue
    assert [(r.rid, r.deaths) for r in queue] == [(run["rid"], 0)]


def test_a_probe_behind_a_request_on_its_worker_times_out_only_from_that_answer(context):
    rig = Harness(context, max_inflight=2, probe={"interval": 1.0, "timeout": 2.0},
                  inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 8]}])
    worker = rig.handles[0]
    client_id = rig.send()
    run, _ = rig.worker_receives(worker)
    worker.probe.due_at = rig.host.now
    rig.router.send_due_probes(rig.pool, rig.pool.ready())
    probe, _ = rig.worker_receives(worker)
    assert probe.get("probe") and worker.probe.rid == probe["rid"]  # behind the request
    rig.host.now += 3.0  # the request's forward takes longer than the probe's timeout (2 s)
    rig.pool.tick(rig.host.now)
    assert not worker.probe.unanswered  # it has not started
    rig.answer(worker, run["rid"], client_id)
    rig.client_receives()
    rig.host.now += 1.5  # 4.5 s since the probe was sent, 1.5 s since it could start
    rig.pool.tick(rig.host.now)
    assert not worker.probe.unanswered and worker.retiring is None
    rig.host.now += 1.0  # 2.5 s since it could start: the worker is stuck in it
    rig.pool.tick(rig.host.now)
    assert worker.probe.unanswered and "probe unanswered" in worker.retiring


def test_a_worker_error_reply_is_relayed_unchanged(context):
    rig = Harness(context)
    worker = rig.handles[0]
    client_id = rig.send()
    run, _ = rig.worker_receives(worker)
    rig.answer(worker, run["rid"], client_id, ok=False)
    header, payload = rig.client_receives()
    assert header == {"id": client_id, "ok": False, "worker": worker.worker_id,
                      "error": {"code": "MODEL_ERROR", "message": "boom"}}
    assert payload == [] and worker.errors == 1


def test_an_identity_past_its_share_of_requests_is_overloaded_and_others_are_served(context):
    rig = Harness(context, max_queue=8)
    rig.host.quotas.shares = Shares(connections=4, buffers=4, buffer_bytes=1 << 20, requests=2,
                                    request_bytes=1 << 20)
    worker = rig.handles[0]
    first = rig.send(identity="uid:1001")
    rig.send(identity="uid:1001")  # queued: the worker holds the first
    refused = rig.send(identity="uid:1001")
    reply, _ = rig.client_receives()
    assert reply["id"] == refused and reply["error"]["code"] == protocol.OVERLOADED
    assert "max_requests_per_identity (2)" in reply["error"]["message"]
    rig.send(identity="uid:1002")  # another identity is accepted (and queued)
    assert rig.router.queued(rig.pool) == 2
    assert rig.host.quotas.holding("uid:1001", "requests") == 2
    run, _ = rig.worker_receives(worker)
    rig.answer(worker, run["rid"], first)
    reply, _ = rig.client_receives()
    assert reply["id"] == first and reply["ok"]
    assert rig.host.quotas.holding("uid:1001", "requests") == 1  # given back with the answer
    third = rig.send(identity="uid:1001")
    assert rig.client_idle() and rig.host.quotas.holding("uid:1001", "requests") == 2, third


def _results_frames(rig, handle, batch: dict, client_ids: list, ok: bool = True) -> tuple[dict, list]:
    """A worker's ``results`` message for the members of ``batch``: (envelope, frames)."""
    frames, sizes = [], []
    for client_id in client_ids:
        reply = {"id": client_id, "ok": True, "outputs": 0, "worker": handle.worker_id,
                 "tensors": [{"dtype": "float32", "shape": [1], "frame": 0}]}
        frames += [protocol.pack(reply), b"\0" * 4]
        sizes.append(2)
    envelope = {"type": protocol.RESULTS, "rids": batch["rids"], "oks": [ok] * len(client_ids),
                "codes": [None] * len(client_ids), "frames": sizes, "compute_us": 9,
                "batch": len(client_ids)}
    return envelope, frames


def test_a_batch_answered_in_one_results_message_answers_every_member_once(context):
    rig = Harness(context, batching={"max_size": 8})
    worker = rig.handles[0]
    busy = rig.send()
    run, _ = rig.worker_receives(worker)
    queued = [rig.send() for _ in range(3)]
    rig.answer(worker, run["rid"], busy)
    rig.client_receives()
    batch, _ = rig.worker_receives(worker)
    assert batch["type"] == protocol.BATCH
    envelope, frames = _results_frames(rig, worker, batch, queued)
    rig.router.on_results(rig.pool, worker, envelope, frames)
    answered = [rig.client_receives()[0] for _ in queued]
    assert [header["id"] for header in answered] == queued
    assert all(header["timing"]["batch"] == 3 and header["timing"]["compute_us"] == 9
               for header in answered)
    rig.router.on_results(rig.pool, worker, envelope, frames)  # again: nothing more
    assert rig.client_idle() and not worker.inflight and not rig.router.pending


@pytest.mark.parametrize("spoil", [
    lambda envelope, frames: (dict(envelope, frames=[2, 2, 1]), frames),  # counts do not add up
    lambda envelope, frames: (dict(envelope, oks=[True, "yes", True]), frames),
    lambda envelope, frames: (dict(envelope, rids=envelope["rids"][:2]), frames),
    lambda envelope, frames: (dict(envelope, codes=None), frames),
    lambda envelope, frames: (envelope, frames[:-1]),
])
def test_a_results_message_that_does_not_add_up_replaces_the_worker(context, spoil):
    rig = Harness(context, workers=2, batching={"max_size": 8})
    worker = rig.handles[0]
    busy = [rig.send(), rig.send()]  # one on each worker
    runs = {handle: rig.worker_receives(handle)[0] for handle in rig.handles}
    queued = [rig.send() for _ in range(3)]
    rig.answer(worker, runs[worker]["rid"], busy[0])
    rig.client_receives()
    batch, _ = rig.worker_receives(worker)
    envelope, frames = spoil(*_results_frames(rig, worker, batch, queued))
    rig.router.on_results(rig.pool, worker, envelope, frames)
    assert worker.retiring is not None  # a replacement is under way; it serves nothing new
    assert rig.client_idle()  # nothing relayed from a message that does not add up
