"""Deadlines, bounded queues, hostile input, input validation, probes, recycling, restart."""

import os
import signal

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from modelwarden.shared import protocol
from modelwarden.client.client import BadInput, Client, ModelError, Overloaded, Timeout
from tests.faulty import GATE, MARKER, reference
from tests.helpers import Daemon, Gate, alive, faulty_model, poll_until, probe_files, raw_request
from tests.load import CapacitySampler, run_load


def slow_echo(name="slow", delay=1.0, workers=1, **extra):
    model = {"name": name, "source": "python:tests.faulty:make_echo",
             "kwargs": {"copy": True, "delay": delay}, "workers": workers, "warmup": 0}
    model.update(extra)
    return model


@pytest.fixture(scope="module")
def daemon():
    models = [slow_echo(max_queue=2), faulty_model("strict", reject_nonfinite=True),
              faulty_model("plain", workers=2)]
    with Daemon(models, daemon={"max_message_bytes": 1 << 20}) as running:
        running.wait_ready()
        yield running


def test_a_request_past_its_deadline_gets_timeout(daemon):
    with Client(daemon.endpoint) as client:
        with pytest.raises(Timeout, match="deadline"):
            client.infer("slow", torch.ones(4), timeout=0.3)
        # the worker finishes the late request and serves the next one normally
        assert torch.equal(client.infer("slow", torch.ones(4), timeout=10), torch.ones(4))


def test_a_request_whose_deadline_passes_behind_another_on_its_worker_is_not_run(tmp_path):
    # One worker holding two (max_inflight 2): the gated request runs, the one behind it waits on
    # the worker itself, and its deadline passes there. Both hold MARKER, which makes the model
    # raise and the worker log it: the log tells which inputs the model ran. Probes are off: one
    # sent to the worker would count in the in-flight numbers this waits on.
    gate = tmp_path / "gate"
    model = {"name": "pair", "source": "python:tests.faulty:make_pair",
             "kwargs": {"gate": str(gate)}, "workers": 1, "cores_per_worker": 1, "threads": 1,
             "warmup": 0, "max_inflight": 2, "probe": {"interval": 0},
             "inputs": [{"name": "a", "dtype": "float32", "shape": [-1, 8]},
                        {"name": "b", "dtype": "float32", "shape": [-1, -1]}]}

    def pair(*fills):
        a = torch.zeros(1, 8)
        a[0, :len(fills)] = torch.tensor(fills)
        return a, torch.zeros(1, 3)

    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, "pair", pair(GATE), gate, 60):
                expired = client.submit("pair", pair(MARKER), timeout=0.3)
                poll_until(lambda: daemon.workers("pair")[0]["inflight"] == 2, 30,
                           message="the second request on the busy worker")
                with pytest.raises(Timeout):
                    expired.result(30)
            with pytest.raises(ModelError):  # run: the worker got to it after the expired one
                client.infer("pair", pair(MARKER), timeout=30)
        log = daemon.log()
    assert log.count("model raised ValueError") == 1, log[-3000:]

def test_a_full_queue_answers_overloaded_at_once_and_loses_nothing(daemon):
    answered: list[int] = []  # futures in the order their answers arrived
    with Client(daemon.endpoint) as client:
        futures = [client.submit("slow", torch.full((4,), float(i)), timeout=30) for i in range(8)]
        for index, future in enumerate(futures):
            future.add_done_callback(lambda _, index=index: answered.append(index))
        ok, overloaded = [], []
        for i, future in enumerate(futures):
            try:
                assert torch.equal(future.result(timeout=60), torch.full((4,), float(i)))
                ok.append(i)
            except Overloaded:
                overloaded.append(i)
    # two held by the worker (max_inflight 2), two queued (max_queue = 2), the rest turned away
    assert ok == [0, 1, 2, 3] and overloaded == [4, 5, 6, 7]
    # "at once": every refusal came back before the first accepted request (1 s of compute) was done
    assert sorted(answered[:4]) == overloaded, answered


def test_nonfinite_inputs_are_rejected_when_the_model_asks(daemon):
    with Client(daemon.endpoint) as client:
        bad = torch.ones(2, 8)
        bad[1, 3] = float("nan")
        with pytest.raises(BadInput, match="NaN or Inf"):
            client.infer("strict", bad)
        bad[1, 3] = float("inf")
        with pytest.raises(BadInput):
            client.infer("strict", bad)
        x = torch.randn(2, 8)
        torch.testing.assert_close(client.infer("strict", x), reference(x))
        with pytest.raises(BadInput, match="dtype"):
            client.infer("strict", torch.ones(2, 8, dtype=torch.float64))
        with pytest.raises(BadInput, match="shape"):
            client.infer("strict", torch.ones(2, 9))


def test_oversized_frames_disconnect_the_peer_and_the_daemon_serves_on(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(daemon.endpoint)
    assert next_event(monitor) == zmq.EVENT_CONNECTED
    header = {"type": "infer", "id": 1, "model": "plain", "inputs": 0,
              "tensors": [{"dtype": "float32", "shape": [2, 2**18], "frame": 0}]}
    sock.send_multipart([protocol.SIGNATURE, protocol.pack(header), bytes(2 * 2**20)])
    assert next_event(monitor) == zmq.EVENT_DISCONNECTED  # the daemon dropped us
    assert not sock.poll(0), "a frame above max_message_bytes must not be answered"
    sock.disable_monitor()
    monitor.close()
    sock.close()
    x = torch.randn(3, 8)
    with Client(daemon.endpoint) as client:
        torch.testing.assert_close(client.infer("plain", x), reference(x))


def next_event(monitor: zmq.Socket, timeout_ms: int = 10_000) -> int:
    assert monitor.poll(timeout_ms), "no socket event"
    return recv_monitor_message(monitor)["event"]


@pytest.mark.parametrize("header", [
    {"type": "infer", "id": 1, "model": "plain", "inputs": list(range(5000)), "tensors": []},
    {"type": "infer", "id": 1, "model": "x" * 100_000, "inputs": 0, "tensors": []},
    {"type": "infer", "id": 1, "model": "plain", "inputs": 0, "tensors": [{"dtype": "float32"}] * 5000},
    {"type": "infer", "id": "i" * 1000, "model": "plain", "inputs": 0, "tensors": []},
    {"type": "infer", "id": 1, "model": "plain", "inputs": list(range(1000)),
     "tensors": [{"dtype": "float32", "shape": [1], "shm": ["0" * 32, 0, 4]}] * 1000},
    {"type": "register", "id": 1},  # buffers register on the buffer channel, not here
])
def test_msgpack_limits_and_schema(daemon, header):
    reply = raw_request(daemon.endpoint, [protocol.SIGNATURE, protocol.pack(header)])
    assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply


def test_deeply_nested_headers_are_refused(daemon):
    # msgpack's own packer refuses such depth: write the bytes by hand (0x91: a 1-element array)
    fields = [("type", "infer"), ("id", 1), ("model", "plain"), ("tensors", [])]
    body = b"".join(protocol.pack(key) + protocol.pack(value) for key, value in fields)
    header = b"\x85" + body + protocol.pack("inputs") + b"\x91" * 2000 + b"\x90"
    reply = raw_request(daemon.endpoint, [protocol.SIGNATURE, header])
    assert reply["error"]["code"] == "BAD_REQUEST"


def test_requests_wait_for_a_worker_while_every_worker_restarts(daemon):
    pids = {w["pid"] for w in daemon.workers("plain")}
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # once the daemon knows they are dead, nothing of "plain" is READY: requests must wait
    poll_until(lambda: not {w["pid"] for w in daemon.workers("plain", "READY")} & pids, 30,
               message="the deaths noticed")
    counts = run_load(daemon.endpoint, "plain", reference, clients=2, requests=10)
    assert counts.reconciles(), counts
    assert counts.ok == counts.sent and counts.wrong == 0, counts
    poll_until(lambda: len(daemon.workers("plain", "READY")) == 2, 60, message="both back")


def test_probe_status_is_reported(daemon):
    worker = poll_until(lambda: next((w for w in daemon.workers("plain")
                                      if w["probe"] and w["probe"]["ok"]), None), 30,
                        message="a probed worker")
    probe = worker["probe"]
    assert probe["last_at"] > 0 and probe["consecutive_failures"] == 0
    assert probe["baseline_us"] > 0 and probe["latency_us"] > 0
    assert probe["drift"] is not None and probe["drift"] <= 1e-5
    assert probe["cuda_bytes"] is None  # a CPU worker holds no CUDA memory (gpu_check: a GPU's)
    assert daemon.status()["models"][2]["golden"] is True
    assert worker["rss_bytes"] > 0


def test_max_requests_recycles_the_worker_without_failing_anything():
    model = faulty_model("recycled", max_requests=15, max_requests_jitter=5)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        first_pid = daemon.workers()[0]["pid"]
        with CapacitySampler(daemon, "recycled") as capacity:
            counts = run_load(daemon.endpoint, "recycled", reference, clients=2, requests=30)
            assert counts.ok == counts.sent == 60 and counts.wrong == 0, counts
            worker = poll_until(lambda: next((w for w in daemon.workers()
                                              if w["state"] == "READY" and w["pid"] != first_pid), None),
                                60, message="a recycled worker")
            poll_until(lambda: not alive(first_pid), 30, message="the recycled worker gone")
        assert any("max_requests" in cause["cause"] for cause in worker["restart_causes"])
        assert capacity.minimum() >= 1, "capacity dipped: retired before it was replaced"


def test_a_probe_failing_every_other_time_does_not_replace_the_worker(tmp_path):
    probe = probe_files(tmp_path)
    flaky = faulty_model("flaky", "flaky_drift", kwargs={"after": 0}, probe=probe)
    # The control: the same probes, failing every time, do replace a worker. Without it this test
    # would pass with replacement broken altogether.
    steady = faulty_model("steady", "flaky_drift", kwargs={"after": 0}, probe={**probe, "failures": 1})
    with Daemon([flaky, steady]) as daemon:
        daemon.wait_ready()
        verdicts: dict[float, bool] = {}  # one entry per probe (its verdict's timestamp)

        def many_probes():
            probe = daemon.workers("flaky")[0]["probe"]
            if probe["last_at"] is not None:
                verdicts[probe["last_at"]] = probe["ok"]
            outcomes = list(verdicts.values())
            return outcomes.count(False) >= 5 and outcomes.count(True) >= 5

        poll_until(many_probes, 60, interval=0.05, message="five probes failing, five passing")
        worker = daemon.workers("flaky")[0]
        assert worker["restarts"] == 0 and worker["retiring"] is None
        poll_until(lambda: daemon.workers("steady")[0]["restarts"] >= 1, 60,
                   message="the control model replaced after one failed probe")


def test_restart_command_revives_a_fatal_slot():
    broken = faulty_model("broken", "load_error", backoff_initial=0.05, max_start_failures=1)
    with Daemon([broken]) as daemon:
        poll_until(lambda: daemon.workers()[0]["state"] == "FATAL", 60, message="FATAL")
        restarts = daemon.workers()[0]["restarts"]
        reply = daemon.command("restart", target="broken")
        assert reply["restarted"] == ["broken#0"]
        poll_until(lambda: daemon.workers()[0]["restarts"] > restarts, 60,
                   message="a new start after the restart command")
