"""Dynamic batching, end to end: real daemon, real workers, requests queued behind a busy worker.

A worker is held busy by a request whose input holds the GATE value (the model waits while a
gate file exists); the requests under test are queued behind it (status shows them queued), then
the gate is removed and the worker takes them as one batch. Nothing here sleeps to synchronise.
"""


import pytest
import torch

from modelwarden import Client
from modelwarden.shared.errors import BadInput, ModelError, Overloaded, Poison, Timeout
from tests.faulty import GATE, MARKER, POISON, pair_reference
from tests import helpers
from tests.helpers import Daemon

WAIT = 60


def pair_model(tmp_path, out: str = "tuple", workers: int = 1, batching: dict | None = None,
               **extra) -> dict:
    model = {"name": "pair", "source": "python:tests.faulty:make_pair",
             "kwargs": {"out": out, "gate": str(tmp_path / "gate")}, "workers": workers,
             "cores_per_worker": 1, "threads": 1, "warmup": 0, "probe": {"interval": 0},
             "inputs": [{"name": "a", "dtype": "float32", "shape": [-1, 8]},
                        {"name": "b", "dtype": "float32", "shape": [-1, -1]}],
             "batching": {"max_size": 16, **(batching or {})}}
    model.update(extra)
    return model


def inputs(rows: int, seed: int, width: int = 3, fill: float | None = None) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, 8, generator=generator)
    if fill is not None:
        a[0, 0] = fill
    return a, torch.randn(rows, width, generator=generator)


def Gate(daemon: Daemon, client: Client, tmp_path) -> helpers.Gate:
    """The only worker of 'pair' held busy (tests/helpers.Gate) while requests queue."""
    return helpers.Gate(daemon, client, 'pair', inputs(1, 0, fill=GATE), tmp_path / "gate", WAIT)


def submit_all(client: Client, requests: list, **kwargs) -> list:
    return [client.submit("pair", args, timeout=kwargs.get("timeout", WAIT), details=True)
            for args in requests]


def assert_same(reply, args: tuple, out: str) -> None:
    expected = pair_reference(*args, out=out)
    got = reply.outputs
    if out == "dict":
        assert set(got) == {"y", "z"}
        got, expected = (got["y"], got["z"]), (expected["y"], expected["z"])
    for g, e in zip(got, expected):
        assert g.shape == e.shape and torch.allclose(g, e, atol=1e-5), (g, e)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
@pytest.mark.parametrize("out", ["tuple", "dict"])
def test_batched_answers_equal_unbatched_answers(tmp_path, out, shm):
    with Daemon([pair_model(tmp_path, out)], daemon={"shm_threshold": 64}) as daemon:
        daemon.wait_ready()
        requests = [inputs(rows, seed) for seed, rows in enumerate([1, 2, 3, 5], start=1)]
        with Client(daemon.endpoint, shm=shm) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            replies = [future.result(WAIT) for future in futures]
        for reply, args in zip(replies, requests):
            assert reply.timing["batch"] == len(requests), reply.timing
            assert_same(reply, args, out)
        batching = daemon.status()["models"][0]["batching"]
        assert batching["histogram"].get(str(len(requests))) == 1, batching
        assert batching["max_size"] == len(requests)


def test_an_identity_model_answers_each_member_with_a_pointer_into_its_own_input(tmp_path):
    # The worker joins the inputs (a copy); a model returning them gives each member its own
    # input back, so a shared-memory input still comes back as a pointer to the client's buffer
    # (no inline 4 MiB replies filling the unread-reply budget under batching).
    with Daemon([pair_model(tmp_path, "identity")], daemon={"shm_threshold": 64}) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            requests = []
            for seed, rows in enumerate([4, 8, 12], start=1):  # >= shm_threshold bytes each
                a, b = client.empty((rows, 8)), client.empty((rows, 16))
                a.copy_(inputs(rows, seed)[0])
                b.copy_(inputs(rows, seed, width=16)[1])
                requests.append((a, b))
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            for future, (a, b) in zip(futures, requests):
                reply = future.result(WAIT)
                assert reply.timing["batch"] == len(requests)
                y, z = reply.outputs
                assert y.data_ptr() == a.data_ptr() and z.data_ptr() == b.data_ptr()


def test_a_lone_request_on_an_idle_pool_is_not_delayed(tmp_path):
    delay_us = 5_000_000
    model = pair_model(tmp_path, batching={"max_delay_us": delay_us})
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            for seed in range(3):
                args = inputs(2, seed)
                reply = client.infer("pair", args, details=True)
                assert reply.timing["batch"] == 1
                assert reply.timing["queue_us"] < delay_us / 10, reply.timing
                assert_same(reply, args, "tuple")


def test_a_partial_batch_under_load_waits_for_more_up_to_max_delay(tmp_path):
    # The first queued request would go alone the moment the gate opens; max_delay_us keeps it
    # for a companion sent only after the gated request was answered.
    model = pair_model(tmp_path, batching={"max_delay_us": 3_000_000})
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            first, second = inputs(1, 1), inputs(2, 2)
            with Gate(daemon, client, tmp_path) as gate:
                early = client.submit("pair", first, timeout=WAIT, details=True)
                gate.queue(1)
            late = client.submit("pair", second, timeout=WAIT, details=True)
            replies = [early.result(WAIT), late.result(WAIT)]
        assert [reply.timing["batch"] for reply in replies] == [2, 2], replies
        assert_same(replies[0], first, "tuple")
        assert_same(replies[1], second, "tuple")


def test_incompatible_requests_are_never_merged(tmp_path):
    with Daemon([pair_model(tmp_path)]) as daemon:
        daemon.wait_ready()
        requests = [inputs(2, seed, width=3 + seed % 2) for seed in range(6)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            replies = [future.result(WAIT) for future in futures]
        for reply, args in zip(replies, requests):
            assert reply.timing["batch"] == 3, reply.timing  # the widths 3 and 4 apart
            assert_same(reply, args, "tuple")


def test_max_size_and_max_rows_cap_a_batch(tmp_path):
    model = pair_model(tmp_path, batching={"max_size": 3, "max_rows": 5})
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        requests = [inputs(2, seed) for seed in range(4)] + [inputs(1, 9)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            replies = [future.result(WAIT) for future in futures]
        # rows 2+2 (a third 2 would pass max_rows) then the 1-row request joins: 2+2+1 = 5
        assert [reply.timing["batch"] for reply in replies] == [3, 3, 2, 2, 3], replies
        for reply, args in zip(replies, requests):
            assert_same(reply, args, "tuple")


def test_an_exception_for_one_member_fails_only_that_member(tmp_path):
    with Daemon([pair_model(tmp_path)]) as daemon:
        daemon.wait_ready()
        requests = [inputs(1, 1), inputs(2, 2, fill=MARKER), inputs(3, 3)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            with pytest.raises(ModelError, match="marker"):
                futures[1].result(WAIT)
            for index in (0, 2):
                assert_same(futures[index].result(WAIT), requests[index], "tuple")
        assert "running each alone" in daemon.log()


def test_a_member_failing_the_input_checks_is_answered_alone(tmp_path):
    with Daemon([pair_model(tmp_path, reject_nonfinite=True)]) as daemon:
        daemon.wait_ready()
        requests = [inputs(1, 1), inputs(2, 2, fill=float("nan")), inputs(3, 3)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            with pytest.raises(BadInput, match="NaN|non-finite|finite"):
                futures[1].result(WAIT)
            for index in (0, 2):
                reply = futures[index].result(WAIT)
                assert reply.timing["batch"] == 2, reply.timing  # the two good ones, together
                assert_same(reply, requests[index], "tuple")


@pytest.mark.slow
def test_a_poison_input_in_a_batch_ends_poison_alone_and_its_batch_mates_succeed(tmp_path):
    model = pair_model(tmp_path, start_seconds=0.1, backoff_initial=0.1)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        requests = [inputs(1, 1), inputs(2, 2, fill=POISON), inputs(1, 3), inputs(2, 4)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            with pytest.raises(Poison):
                futures[1].result(WAIT)
            for index in (0, 2, 3):
                reply = futures[index].result(WAIT)
                assert reply.timing["batch"] == 1, reply.timing  # retried one per forward
                assert_same(reply, requests[index], "tuple")
        daemon.wait_ready()
        causes = [c["cause"] for w in daemon.workers() for c in w["restart_causes"]]
        assert causes.count("SIGKILL") == 2, causes  # the batch, then the poison input alone


def test_deadlines_and_overloaded_hold_under_batching(tmp_path):
    with Daemon([pair_model(tmp_path, max_queue=3)]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                short = client.submit("pair", inputs(1, 1), timeout=0.5)
                futures = submit_all(client, [inputs(1, 2), inputs(1, 3)])
                gate.queue(3)
                with pytest.raises(Overloaded):
                    client.infer("pair", inputs(1, 4))
                with pytest.raises(Timeout):
                    short.result(WAIT)  # its deadline passes while the gate holds the worker
            replies = [future.result(WAIT) for future in futures]
        assert [reply.timing["batch"] for reply in replies] == [2, 2]
        assert daemon.status()["daemon"]["pending"] == 0


def test_a_batch_member_whose_deadline_passes_behind_another_on_its_worker_is_not_run(tmp_path):
    # Both wait in the queue behind the gated request (max_inflight 1); a reload raises
    # max_inflight to 3 and they go to the busy worker as one batch behind it, where the first
    # one's deadline passes. It holds MARKER: run, the model would raise and the worker log it.
    model = pair_model(tmp_path, max_inflight=1)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                expiring = client.submit("pair", inputs(1, 1, fill=MARKER), timeout=6.0)
                (kept,) = submit_all(client, [inputs(1, 2)])
                gate.queue(2)
                helpers.rewrite_config(daemon, [{**model, "max_inflight": 3}])
                assert daemon.command("reload")["changes"] == ["pair: applied in place: max_inflight"]
                helpers.poll_until(lambda: daemon.workers("pair")[0]["inflight"] == 3, WAIT,
                                   message="the batch of two behind the gated request")
                with pytest.raises(Timeout):
                    expiring.result(WAIT)
            reply = kept.result(WAIT)
        assert_same(reply, inputs(1, 2), "tuple")
        assert reply.timing["batch"] == 1  # its mate was answered before the forward, unrun
        assert "model raised ValueError" not in daemon.log()


def test_batching_off_is_one_request_per_forward(tmp_path):
    # max_inflight 1, as batching's default: the three wait in the queue behind the gate
    with Daemon([pair_model(tmp_path, batching={"max_size": 1}, max_inflight=1)]) as daemon:
        daemon.wait_ready()
        requests = [inputs(1, seed) for seed in range(3)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = submit_all(client, requests)
                gate.queue(len(requests))
            replies = [future.result(WAIT) for future in futures]
        assert [reply.timing["batch"] for reply in replies] == [1, 1, 1]
        assert daemon.status()["models"][0]["batching"] is None
