"""Shared-memory payloads: byte-exact round trips, hostile descriptors, and no leaks."""

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import zmq

from modelwarden.shared import protocol, shm
from modelwarden.shared.client import BadRequest, Client
from modelwarden.shared.codec import TORCH_DTYPES
from tests.helpers import ROOT, Daemon, alive, our_segments, poll_until

THRESHOLD = 4096  # small, so modest tensors take the shared-memory path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def echo(name: str, copy: bool, workers: int = 1, **extra) -> dict:
    model = {"name": name, "source": "python:tests.faulty:make_echo", "kwargs": {"copy": copy},
             "workers": workers, "warmup": 0, "cores_per_worker": 1}
    model.update(extra)
    return model


@pytest.fixture(scope="module")
def daemon():
    tcp = f"tcp://127.0.0.1:{free_port()}"  # a second frontend: same daemon, inline frames only
    with Daemon([echo("alias", copy=False), echo("fresh", copy=True, workers=2)],
                daemon={"shm_threshold": THRESHOLD}, extra_frontends=[tcp]) as running:
        running.tcp = tcp
        running.wait_ready()
        yield running


def sample(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a = a.contiguous().reshape(-1).view(torch.uint8)
    flat_b = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(flat_a, flat_b)


PATHS = ["shm", "inline-ipc", "inline-tcp"]


def client_for(daemon, path: str) -> Client:
    if path == "shm":
        return Client(daemon.endpoint)
    if path == "inline-ipc":
        return Client(daemon.endpoint, shm=False)
    return Client(daemon.tcp)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model", ["alias", "fresh"])
@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_every_dtype_round_trips_byte_exact(daemon, path, model, dtype):
    torch_dtype = TORCH_DTYPES[dtype]
    x = sample(torch_dtype, (64, 33))  # >= THRESHOLD bytes for every dtype
    with client_for(daemon, path) as client:
        y = client.infer(model, x)
        assert same_bytes(y, x), dtype


@pytest.mark.parametrize("path", PATHS)
def test_structures_and_odd_shapes_round_trip(daemon, path):
    big = sample(torch.float32, (128, 64))
    inputs = {
        "noncontiguous": big.t(),
        "strided": big[::2, 1::3],
        "empty": torch.empty(0, 64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "bf16": sample(torch.bfloat16, (40, 70)),
        "flags": sample(torch.bool, (5000,)),
    }
    with client_for(daemon, path) as client:
        out = client.infer("fresh", inputs)
        assert set(out) == set(inputs)
        for key, value in inputs.items():
            assert same_bytes(out[key], value), key
        pair = (sample(torch.int64, (1000,)), sample(torch.float16, (3,)))
        out = client.infer("alias", pair)
        assert isinstance(out, tuple) and all(same_bytes(a, b) for a, b in zip(out, pair))


def test_shm_path_is_really_taken_and_outputs_alias_inputs(daemon):
    with Client(daemon.endpoint) as client:
        x = client.empty((256, 256))
        x.copy_(sample(torch.float32, (256, 256)))
        y = client.infer("alias", x)
        assert y.data_ptr() == x.data_ptr()  # the worker answered with a pointer to our buffer
        ours = set(client._session.arena.names())
        assert ours and ours <= our_segments()
        fresh = client.infer("fresh", x)
        assert fresh.data_ptr() != x.data_ptr() and torch.equal(fresh, x)
        # the output lives in one of our segments: zero-copy on the way back too
        assert client._session.arena.locate(fresh.data_ptr(), fresh.numel() * 4) is not None


def test_outputs_stay_valid_while_held_and_buffers_are_reused_after(daemon):
    with Client(daemon.endpoint) as client:
        kept = [client.infer("fresh", torch.full((64, 64), float(i))) for i in range(5)]
        for i, tensor in enumerate(kept):
            assert torch.all(tensor == float(i))
        count = len(client._session.arena.names())
        del kept
        for i in range(20):
            assert torch.all(client.infer("fresh", torch.full((64, 64), float(i))) == float(i))
        assert len(client._session.arena.names()) <= count + 2


# -- hostile descriptors -------------------------------------------------------------------------


class RawConnection:
    """A DEALER that speaks the protocol by hand, for descriptors a real client never sends."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.ids = 0

    def request(self, header: dict, *payload: bytes) -> dict:
        self.ids += 1
        header = {**header, "id": self.ids}
        self.socket.send_multipart([protocol.SIGNATURE, protocol.pack(header), *payload])
        while True:
            assert self.socket.poll(15_000), "no reply"
            reply = protocol.unpack_header(self.socket.recv_multipart()[1])
            if reply.get("id") == self.ids:
                return reply

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def segment():
    created = shm.create_segment(64 * 1024)
    yield created
    shm.unlink(created.name)
    created.close()


def infer_on(name: str, offset: int, nbytes: int, shape=None) -> dict:
    shape = shape if shape is not None else [nbytes // 4]
    return {"type": "infer", "model": "alias", "inputs": 0,
            "tensors": [{"dtype": "float32", "shape": shape, "shm": [name, offset, nbytes]}]}


def assert_rejected(reply: dict, secret: str) -> None:
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == "BAD_REQUEST", reply
    assert secret not in reply["error"]["message"]  # errors never echo segment names


def assert_still_serving(daemon) -> None:
    x = sample(torch.float32, (64, 64))
    with Client(daemon.endpoint) as client:
        assert torch.equal(client.infer("alias", x), x)


def test_valid_raw_shm_request_is_served(daemon, segment):
    connection = RawConnection(daemon.endpoint)
    try:
        assert connection.request({"type": "register", "segments": [[segment.name, segment.size]]})["ok"]
        reply = connection.request(infer_on(segment.name, 4096, 8192))
        assert reply["ok"], reply
        assert reply["tensors"][0]["shm"] == [segment.name, 4096, 8192]
    finally:
        connection.close()


OFFSET_ATTACKS = {
    "offset near 2**64": (2**64 - 32, 16),
    "length past the end": (0, 64 * 1024 + 4),
    "offset past the end": (64 * 1024, 4),
    "negative offset": (-4, 16),
    "negative length": (0, -16),
}


@pytest.mark.parametrize("attack", sorted(OFFSET_ATTACKS))
def test_out_of_bounds_descriptors_are_rejected(daemon, segment, attack):
    offset, nbytes = OFFSET_ATTACKS[attack]
    connection = RawConnection(daemon.endpoint)
    try:
        assert connection.request({"type": "register", "segments": [[segment.name, segment.size]]})["ok"]
        header = infer_on(segment.name, offset, nbytes, shape=[max(nbytes, 0) // 4])
        assert_rejected(connection.request(header), segment.name)
        out_attack = infer_on(segment.name, 0, 16)
        out_attack["out"] = [segment.name, offset, nbytes]
        assert_rejected(connection.request(out_attack), segment.name)
    finally:
        connection.close()
    assert_still_serving(daemon)


def test_a_segment_of_another_client_is_rejected(daemon, segment):
    owner, thief = RawConnection(daemon.endpoint), RawConnection(daemon.endpoint)
    try:
        assert owner.request({"type": "register", "segments": [[segment.name, segment.size]]})["ok"]
        assert_rejected(thief.request(infer_on(segment.name, 0, 16)), segment.name)
        assert_rejected(thief.request({"type": "register", "segments": [[segment.name, segment.size]]}),
                        segment.name)
        assert owner.request(infer_on(segment.name, 0, 16))["ok"]
    finally:
        owner.close()
        thief.close()
    assert_still_serving(daemon)


def test_an_unregistered_segment_is_rejected(daemon, segment):
    connection = RawConnection(daemon.endpoint)
    try:
        assert_rejected(connection.request(infer_on(segment.name, 0, 16)), segment.name)
    finally:
        connection.close()


@pytest.mark.parametrize("name", ["../../etc/passwd", "mw.1.2/../../x", "/dev/shm/mw.1.2.x",
                                  "mw.1.2." + "0" * 31 + "/", "psm_12345", "mw..", ""])
def test_names_that_are_not_client_segments_are_rejected(daemon, name):
    connection = RawConnection(daemon.endpoint)
    try:
        assert_rejected(connection.request({"type": "register", "segments": [[name, 4096]]}), name or "\0")
        assert_rejected(connection.request(infer_on(name, 0, 16)), name or "\0")
    finally:
        connection.close()
    assert_still_serving(daemon)


def test_a_name_of_the_daemons_own_is_rejected(daemon):
    pids = [daemon.process.pid] + daemon.worker_pids()
    connection = RawConnection(daemon.endpoint)
    created = []
    try:
        for pid in pids:
            name = f"mw.{pid}.{shm.process_start_ticks(pid)}.{'ab' * 16}"
            fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
            created.append(name)
            assert_rejected(connection.request({"type": "register", "segments": [[name, 4096]]}), name)
    finally:
        connection.close()
        for name in created:
            shm.unlink(name)
    assert_still_serving(daemon)


def test_registering_more_than_the_segment_holds_is_rejected(daemon, segment):
    connection = RawConnection(daemon.endpoint)
    try:
        reply = connection.request({"type": "register", "segments": [[segment.name, segment.size + 1]]})
        assert_rejected(reply, segment.name)
    finally:
        connection.close()


def test_a_segment_truncated_before_the_request_is_rejected(daemon, segment):
    connection = RawConnection(daemon.endpoint)
    try:
        assert connection.request({"type": "register", "segments": [[segment.name, segment.size]]})["ok"]
        assert connection.request(infer_on(segment.name, 32768, 1024))["ok"]  # mapped now
        os.truncate(f"/dev/shm/{segment.name}", 4096)
        assert_rejected(connection.request(infer_on(segment.name, 32768, 1024)), segment.name)
    finally:
        connection.close()
    assert_still_serving(daemon)


def test_tcp_clients_cannot_register_segments(daemon, segment):
    connection = RawConnection(daemon.tcp)
    try:
        assert_rejected(connection.request({"type": "register", "segments": [[segment.name, segment.size]]}),
                        segment.name)
    finally:
        connection.close()


# -- crashes and leaks ---------------------------------------------------------------------------


def test_segment_truncated_under_a_worker_kills_only_that_worker():
    slow = echo("slow", copy=True, workers=2, kwargs={"copy": True, "delay": 1.0})
    with Daemon([slow], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            x = client.empty((1024, 64))
            x.fill_(1.0)
            future = client.submit("slow", x)
            busy = poll_until(lambda: next((w for w in daemon.workers() if w["inflight"]), None), 10,
                              message="a worker holding the request")
            name = client._session.arena.locate(x.data_ptr(), 4)[0].name
            os.truncate(f"/dev/shm/{name}", 0)
            with pytest.raises(BadRequest):  # the retry finds the segment truncated
                future.result(timeout=30)
            poll_until(lambda: any(w["last_exit"] == "SIGBUS" for w in daemon.workers()), 30,
                       message="a worker dead of SIGBUS")
            poll_until(lambda: all(w["state"] == "READY" for w in daemon.workers()), 60,
                       message="the pool back to READY")
            assert not alive(busy["pid"])
            y = client.infer("slow", torch.ones(1024, 64))
            assert torch.equal(y, torch.ones(1024, 64))


CLIENT_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from modelwarden.shared.client import Client
    client = Client({endpoint!r})
    x = client.empty((512, 512)); x.fill_(2.0)
    client.infer("slow", x)
    future = client.submit("slow", x)   # in flight when we are killed
    print("ready", flush=True)
    future.result()
""")


def test_no_leaks_after_client_kill_worker_kill_and_daemon_stop():
    baseline = our_segments()
    slow = echo("slow", copy=True, workers=2, kwargs={"copy": True, "delay": 0.5})
    with Daemon([slow], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        # 1. normal use, then close: nothing left
        with Client(daemon.endpoint) as client:
            assert torch.equal(client.infer("slow", torch.ones(256, 256)), torch.ones(256, 256))
            assert our_segments() - baseline
        assert our_segments() == baseline

        # 2. a client SIGKILLed mid-request: the daemon sweeps its segments
        script = CLIENT_SCRIPT.format(root=str(ROOT), endpoint=daemon.endpoint)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        assert our_segments() - baseline
        child.kill()
        child.wait()
        poll_until(lambda: our_segments() == baseline, 20, message="the dead client's segments swept")

        # 3. a worker SIGKILLed: a live client's segments survive and stay usable
        with Client(daemon.endpoint) as client:
            x = client.empty((256, 256))
            x.fill_(3.0)
            assert torch.equal(client.infer("slow", x), x)
            mine = our_segments() - baseline
            killed = set(daemon.worker_pids())
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            poll_until(lambda: len({w["pid"] for w in daemon.workers(state="READY")} - killed) == 2,
                       60, message="two new workers READY")
            assert our_segments() - baseline == mine
            assert torch.equal(client.infer("slow", x), x)

            # 4. the daemon stopped: only the live client's segments remain
            assert daemon.stop() == 0
            assert our_segments() - baseline == mine
        assert our_segments() == baseline


def test_threads_and_futures_share_one_clients_shared_memory(daemon):
    import threading

    with Client(daemon.endpoint) as client:
        made = client.empty((128, 128))
        made.copy_(sample(torch.float32, (128, 128), seed=7))
        futures = [client.submit("fresh", made) for _ in range(10)]
        results, errors = [], []

        def worker(seed):
            try:
                x = sample(torch.float32, (128, 64), seed=seed)
                results.append(same_bytes(client.infer("fresh", x), x)
                               and same_bytes(client.infer("alias", made), made))
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert results == [True] * 4
        assert all(same_bytes(future.result(timeout=30), made) for future in futures)


def test_clients_survive_a_daemon_restart():
    import asyncio

    from modelwarden.shared.client import AsyncClient

    with Daemon([echo("fresh", copy=True)], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        x = sample(torch.float32, (64, 64))
        client = Client(daemon.endpoint)
        try:
            made = client.empty((64, 64))
            made.copy_(x)
            assert same_bytes(client.infer("fresh", made), x)
            assert same_bytes(client.submit("fresh", x).result(timeout=30), x)
            assert daemon.stop() == 0
            daemon.start()  # a new daemon knows none of this client's segments
            daemon.wait_ready()
            assert same_bytes(client.infer("fresh", made), x)  # registers again and resends
            assert same_bytes(client.infer("fresh", x), x)
            assert same_bytes(client.submit("fresh", made).result(timeout=30), x)

            async def use_async():
                async with AsyncClient(daemon.endpoint) as async_client:
                    return await async_client.infer("fresh", x)

            assert same_bytes(asyncio.run(use_async()), x)
        finally:
            client.close()
