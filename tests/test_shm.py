"""Shared-memory payloads: byte-exact round trips, hostile descriptors and channel messages, buffers
as capabilities (tokens), and no leaks after SIGKILLs."""

import fcntl
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import zmq

from modelwarden.shared import fdchannel, protocol, shm
from modelwarden.client.client import Client
from modelwarden.shared.codec import TORCH_DTYPES
from modelwarden.supervisor.routing.buffers import MAX_BUFFERS_PER_CONNECTION
from tests.helpers import (ROOT, Daemon, cmdline, fd_count, free_port, memfd_holders, poll_until,
                           readline_within, shmem_kib, temporary_user)

THRESHOLD = 4096  # small, so modest tensors take the shared-memory path



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
        running.channel = str(running.dir / "run" / "buffers.sock")
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
        ours = client._session.arena.tokens()
        assert ours and all(re.fullmatch(r"[0-9a-f]{32}", token) for token in ours)
        assert memfd_holders().get(os.getpid()) == len(ours)  # memfds: nothing in /dev/shm
        assert daemon.process.pid in memfd_holders()  # the daemon holds its copies
        fresh = client.infer("fresh", x)
        assert fresh.data_ptr() != x.data_ptr() and torch.equal(fresh, x)
        # the output lives in one of our buffers: zero-copy on the way back too
        assert client._session.arena.locate(fresh.data_ptr(), fresh.numel() * 4) is not None
    assert not memfd_holders().get(os.getpid())


def test_copy_outputs_gives_ordinary_tensors_over_shared_memory(daemon):
    x = torch.randn(64, 64)
    with Client(daemon.endpoint, copy_outputs=True) as client:
        y = client.infer("fresh", x)  # 16 KiB in and out: both ways through shared memory
        assert client._session.arena is not None and client._session.arena.tokens()
        assert torch.equal(y, x)
        assert client._session.arena.locate(y.data_ptr(), y.numel() * 4) is None  # not a view
    assert torch.equal(y, x)  # still valid after the client and its buffers are gone


def test_outputs_stay_valid_while_held_and_buffers_are_reused_after(daemon):
    with Client(daemon.endpoint) as client:
        kept = [client.infer("fresh", torch.full((64, 64), float(i))) for i in range(5)]
        for i, tensor in enumerate(kept):
            assert torch.all(tensor == float(i))
        count = len(client._session.arena.tokens())
        del kept
        for i in range(20):
            assert torch.all(client.infer("fresh", torch.full((64, 64), float(i))) == float(i))
        assert len(client._session.arena.tokens()) <= count + 2


def test_sealed_buffers_cannot_shrink_or_grow(daemon):
    with Client(daemon.endpoint) as client:
        x = client.empty((1024, 64))
        x.fill_(1.0)
        segment, _ = client._session.arena.locate(x.data_ptr(), 4)
        for size in (0, segment.size * 2):
            with pytest.raises(PermissionError):  # EPERM: sealed; no SIGBUS under a worker
                os.ftruncate(segment.fd, size)
        assert torch.equal(client.infer("fresh", x), x)


# -- raw peers: a DEALER and a buffer-channel socket spoken by hand ---------------------------------


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


class RawChannel:
    """A buffer-channel client written against the spec with nothing but the socket module."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(15)
        self.sock.connect(path)
        self.ids = 0

    def call(self, message: dict, fds: list[int] = ()) -> dict:
        self.ids += 1
        socket.send_fds(self.sock, [protocol.pack({**message, "id": self.ids})], list(fds))
        data, ancdata, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
        assert not ancdata, "the daemon never sends descriptors"
        return protocol.unpack_header(data)

    def register(self, *fds: int) -> list[str]:
        reply = self.call({"type": "register"}, fds)
        assert reply["ok"], reply
        return reply["tokens"]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def buffer(daemon):
    """A 64 KiB sealed memfd registered on a raw channel connection: (segment, token, channel)."""
    segment = shm.create_segment(64 * 1024)
    channel = RawChannel(daemon.channel)
    try:
        (token,) = channel.register(segment.fd)
        yield segment, token, channel
    finally:
        channel.close()
        segment.close()


def infer_on(token: str, offset: int, nbytes: int, shape=None) -> dict:
    shape = shape if shape is not None else [nbytes // 4]
    return {"type": "infer", "model": "alias", "inputs": 0,
            "tensors": [{"dtype": "float32", "shape": shape, "shm": [token, offset, nbytes]}]}


def assert_rejected(reply: dict, secret: str, detail: str | None = None) -> None:
    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == "BAD_REQUEST", reply
    assert secret not in reply["error"]["message"]  # errors never echo a token
    if detail is not None:
        assert reply["error"].get("detail") == detail, reply


def assert_still_serving(daemon) -> None:
    x = sample(torch.float32, (64, 64))
    with Client(daemon.endpoint) as client:
        assert torch.equal(client.infer("alias", x), x)


def test_valid_raw_shm_request_is_served(daemon, buffer):
    segment, token, _ = buffer
    segment.array[4096:4096 + 8192] = 7
    connection = RawConnection(daemon.endpoint)
    try:
        reply = connection.request(infer_on(token, 4096, 8192))
        assert reply["ok"], reply
        assert reply["tensors"][0]["shm"] == [token, 4096, 8192]
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
def test_out_of_bounds_descriptors_are_rejected(daemon, buffer, attack):
    _, token, _ = buffer
    offset, nbytes = OFFSET_ATTACKS[attack]
    connection = RawConnection(daemon.endpoint)
    try:
        header = infer_on(token, offset, nbytes, shape=[max(nbytes, 0) // 4])
        assert_rejected(connection.request(header), token)
        out_attack = infer_on(token, 0, 16)
        out_attack["out"] = [token, offset, nbytes]
        assert_rejected(connection.request(out_attack), token)
    finally:
        connection.close()
    assert_still_serving(daemon)


def test_a_guessed_token_is_refused(daemon, buffer):
    guess = secrets.token_hex(16)
    connection = RawConnection(daemon.endpoint)
    try:
        assert_rejected(connection.request(infer_on(guess, 0, 16)), guess, protocol.BUFFER_NOT_REGISTERED)
        _, token, _ = buffer
        out = infer_on(token, 0, 16)
        out["out"] = [guess, 0, 16]
        assert_rejected(connection.request(out), guess, protocol.BUFFER_NOT_REGISTERED)
    finally:
        connection.close()


def test_the_token_is_the_authority_any_connection_presenting_it_may_use_it(daemon, buffer):
    _, token, _ = buffer
    first, second = RawConnection(daemon.endpoint), RawConnection(daemon.endpoint)
    try:
        assert first.request(infer_on(token, 0, 16))["ok"]
        assert second.request(infer_on(token, 0, 16))["ok"]
    finally:
        first.close()
        second.close()


def test_a_token_dies_with_the_channel_connection_that_registered_it(daemon):
    supervisor = daemon.process.pid
    connection = RawConnection(daemon.endpoint)
    assert connection.request({"type": "hello"})["ok"]  # connected: its socket counts from here
    before = settled_fd_count(supervisor)
    segment = shm.create_segment(64 * 1024)
    channel = RawChannel(daemon.channel)
    try:
        (token,) = channel.register(segment.fd)
        assert connection.request(infer_on(token, 0, 16))["ok"]
        channel.close()  # the client hung up: its tokens are revoked, its descriptors closed
        poll_until(lambda: not connection.request(infer_on(token, 0, 16))["ok"], 10,
                   message="the token refused")
        assert_rejected(connection.request(infer_on(token, 0, 16)), token, protocol.BUFFER_NOT_REGISTERED)
        fds_are(supervisor, before)
        assert supervisor not in memfd_holders()
    finally:
        connection.close()
        segment.close()


def test_unregister_revokes_only_the_callers_tokens(daemon):
    mine, other = shm.create_segment(64 * 1024), shm.create_segment(64 * 1024)
    owner, stranger = RawChannel(daemon.channel), RawChannel(daemon.channel)
    connection = RawConnection(daemon.endpoint)
    try:
        (token,) = owner.register(mine.fd)
        (kept,) = stranger.register(other.fd)
        assert owner.call({"type": "unregister", "tokens": [kept]})["ok"]  # not its own: ignored
        assert connection.request(infer_on(kept, 0, 16))["ok"]
        assert owner.call({"type": "unregister", "tokens": [token]})["ok"]
        assert_rejected(connection.request(infer_on(token, 0, 16)), token, protocol.BUFFER_NOT_REGISTERED)
    finally:
        for closable in (owner, stranger, connection, mine, other):
            closable.close()


def test_a_queued_request_whose_token_is_revoked_is_answered_buffer_not_registered():
    # one request in the worker at a time: the second waits in the queue
    slow = echo("slow", copy=True, kwargs={"copy": True, "delay": 1.0}, max_inflight=1)
    with Daemon([slow], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        segment = shm.create_segment(64 * 1024)
        channel = RawChannel(str(daemon.dir / "run" / "buffers.sock"))
        connection = RawConnection(daemon.endpoint)
        try:
            (token,) = channel.register(segment.fd)
            busy = {"type": "infer", "id": "busy", "model": "slow", "inputs": 0,
                    "tensors": [{"dtype": "float32", "shape": [4], "frame": 0}]}
            connection.socket.send_multipart([protocol.SIGNATURE, protocol.pack(busy), bytes(16)])
            poll_until(lambda: daemon.status()["models"][0]["queued"] == 0
                       and any(w["inflight"] for w in daemon.workers()), 10, message="the worker busy")
            queued = {**infer_on(token, 0, 16), "model": "slow", "id": "queued"}
            connection.socket.send_multipart([protocol.SIGNATURE, protocol.pack(queued)])
            poll_until(lambda: daemon.status()["models"][0]["queued"] == 1, 10, message="queued")
            channel.close()  # revoked while the request waits in the queue
            replies = {}
            while len(replies) < 2:
                assert connection.socket.poll(15_000), "no reply"
                reply = protocol.unpack_header(connection.socket.recv_multipart()[1])
                replies[reply["id"]] = reply
            assert replies["busy"]["ok"]
            assert_rejected(replies["queued"], token, protocol.BUFFER_NOT_REGISTERED)
        finally:
            connection.close()
            segment.close()


@pytest.mark.parametrize("value", ["../../etc/passwd", "mw.1.2." + "0" * 32, "/dev/shm/x",
                                   "0" * 31, "0" * 33, "A" * 32, "0" * 31 + "\n", "", None, 7])
def test_values_that_are_not_tokens_are_rejected(daemon, value):
    connection = RawConnection(daemon.endpoint)
    try:
        assert_rejected(connection.request(infer_on(value, 0, 16)), str(value) or "\0")
    finally:
        connection.close()
    assert_still_serving(daemon)


def test_tcp_clients_cannot_use_buffers(daemon, buffer):
    _, token, _ = buffer
    connection = RawConnection(daemon.tcp)
    try:
        assert_rejected(connection.request(infer_on(token, 0, 16)), token)
    finally:
        connection.close()


# -- hostile channel messages: refused, and every descriptor closed ----------------------------------


def fds_are(pid: int, count: int) -> None:
    """The supervisor opens files for a moment now and then (/proc reads): poll for the count."""
    poll_until(lambda: fd_count(pid) == count, 10,
               message=f"{count} descriptors open in {pid} (now {fd_count(pid)})")


def settled_fd_count(pid: int) -> int:
    """The supervisor's descriptors once the count has held for half a second: a daemon just
    started may still hold a worker's spawn pipe, closed a moment later."""
    counts: list[int] = []
    poll_until(lambda: counts.append(fd_count(pid)) or (len(counts) >= 10
                                                      and len(set(counts[-10:])) == 1),
               30, message=f"a steady descriptor count in {pid} (last {counts[-10:]})")
    return counts[-1]


def unsealed_memfd() -> int:
    fd = os.memfd_create("modelwarden", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 65536)
    return fd


def grow_sealed_memfd() -> int:
    fd = unsealed_memfd()
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    return fd


def empty_sealed_memfd() -> int:
    fd = os.memfd_create("modelwarden", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def regular_file() -> int:
    handle = tempfile.TemporaryFile()
    handle.write(b"x" * 65536)
    handle.flush()
    fd = os.dup(handle.fileno())
    handle.close()
    return fd


def pipe_end() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


NOT_BUFFERS = {"regular file": regular_file, "unsealed memfd": unsealed_memfd,
               "memfd sealed only against growing": grow_sealed_memfd,
               "empty sealed memfd": empty_sealed_memfd, "pipe": pipe_end}


@pytest.mark.parametrize("kind", sorted(NOT_BUFFERS))
def test_descriptors_that_are_not_sealed_memfds_are_refused(daemon, kind):
    supervisor = daemon.process.pid
    before = settled_fd_count(supervisor)
    good = shm.create_segment(64 * 1024)
    bad_fd = NOT_BUFFERS[kind]()
    channel = RawChannel(daemon.channel)
    try:
        reply = channel.call({"type": "register"}, [bad_fd])
        assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply
        reply = channel.call({"type": "register"}, [good.fd, bad_fd])  # all or nothing
        assert reply["ok"] is False and "tokens" not in reply, reply
        fds_are(supervisor, before + 1)  # only the channel connection itself
    finally:
        channel.close()
        os.close(bad_fd)
        good.close()
    fds_are(supervisor, before)


def test_too_many_descriptors_and_garbage_leak_nothing(daemon):
    supervisor = daemon.process.pid
    before = settled_fd_count(supervisor)
    segment = shm.create_segment(64 * 1024)
    channel = RawChannel(daemon.channel)
    try:
        copies = [os.dup(segment.fd) for _ in range(fdchannel.MAX_FDS_PER_MESSAGE + 8)]
        reply = channel.call({"type": "register"}, copies)  # more than the daemon reads: CTRUNC
        assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply
        for message, fds in [({"type": "register"}, []), ({"type": "unregister", "tokens": ["0" * 32]}, copies[:3]),
                             ({"type": "hello"}, copies[:2]), ({"type": "unregister", "tokens": "x"}, [])]:
            reply = channel.call(message, fds)
            assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", (message, reply)
        socket.send_fds(channel.sock, [b"\xc1 not msgpack"], copies[:4])
        reply = protocol.unpack_header(channel.sock.recv(65536))
        assert reply["ok"] is False and reply["id"] is None, reply
        channel.sock.send(b"x" * 100_000)  # longer than a channel message: MSG_TRUNC
        assert protocol.unpack_header(channel.sock.recv(65536))["ok"] is False
        fds_are(supervisor, before + 1)  # only the channel connection itself
        for fd in copies:
            os.close(fd)
        (token,) = channel.register(segment.fd)  # the connection still works after all that
        assert re.fullmatch(r"[0-9a-f]{32}", token)
    finally:
        channel.close()
        segment.close()
    fds_are(supervisor, before)
    assert_still_serving(daemon)


def test_a_connection_may_register_only_so_many_buffers(daemon):
    supervisor = daemon.process.pid
    before = settled_fd_count(supervisor)
    segment = shm.create_segment(64 * 1024)
    channel = RawChannel(daemon.channel)
    try:
        batch = [segment.fd] * fdchannel.MAX_FDS_PER_MESSAGE
        for _ in range(MAX_BUFFERS_PER_CONNECTION // len(batch)):
            channel.register(*batch)
        fds_are(supervisor, before + 1 + MAX_BUFFERS_PER_CONNECTION)
        reply = channel.call({"type": "register"}, [segment.fd])
        assert reply["ok"] is False and reply["error"]["code"] == "BAD_REQUEST", reply
    finally:
        channel.close()
        segment.close()
    fds_are(supervisor, before)


# -- another user's buffers ----------------------------------------------------------------------------

# Runs as another user under the system Python: nothing but the standard library, as a client in
# any language would be (msgpack written by hand: {"type": "register", "id": 1}).
OTHER_USER_CLIENT = textwrap.dedent("""
    import fcntl, os, re, socket, sys
    fd = os.memfd_create("modelwarden", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(sys.argv[1])
    socket.send_fds(sock, [b"\\x82\\xa4type\\xa8register\\xa2id\\x01"], [fd])
    reply = sock.recv(65536)
    print(re.search(rb"[0-9a-f]{32}", reply).group().decode(), flush=True)
    sys.stdin.read()   # holds the channel connection open until the test closes stdin
""")


@pytest.fixture
def other_user():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user and a group")
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs a system /usr/bin/python3 the other user can run")
    with temporary_user("mwcap") as (user, group):
        yield user, group


def test_another_users_token_is_known_only_to_whoever_it_was_given_to(other_user):
    user, group = other_user
    with Daemon([echo("alias", copy=False)], daemon={"shm_threshold": THRESHOLD, "shm_group": group,
                                                      "log_level": "DEBUG"}) as daemon:
        daemon.wait_ready()
        os.chmod(daemon.dir, 0o711)  # the runtime dir inside is 0770 for the group
        stranger = subprocess.Popen(
            ["setpriv", "--reuid", user, "--regid", group, "--init-groups", "/usr/bin/python3",
             "-c", OTHER_USER_CLIENT, str(daemon.dir / "run" / "buffers.sock")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        connection = RawConnection(daemon.endpoint)
        try:
            token = readline_within(stranger.stdout).strip()
            assert re.fullmatch(r"[0-9a-f]{32}", token), token
            for _ in range(20):  # guessing gets nowhere
                guess = secrets.token_hex(16)
                assert_rejected(connection.request(infer_on(guess, 0, 16)), guess,
                                protocol.BUFFER_NOT_REGISTERED)
            # Knowing it is all it takes (a capability): used once, so a worker holds it too.
            reply = connection.request(infer_on(token, 0, 4096))
            assert reply["ok"] and reply["tensors"][0]["shm"][0] == token, reply
            # ... and nothing the test could read without being given it reveals it.
            status = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--json",
                                     "--config", str(daemon.config_path)], cwd=ROOT,
                                    capture_output=True, text=True, timeout=30)
            assert json.loads(status.stdout) and token not in status.stdout + status.stderr
            assert token not in daemon.log()
            assert f"uid {pwd_uid(user)}" in daemon.log()  # peers are logged by credentials
            for pid in [daemon.process.pid, *daemon.worker_pids()]:
                assert token not in cmdline(pid)
                assert token.encode() not in open(f"/proc/{pid}/environ", "rb").read()
            assert not any(token in name for name in os.listdir("/dev/shm"))
        finally:
            connection.close()
            stranger.stdin.close()
            stranger.wait(10)
        poll_until(lambda: not memfd_holders(exclude=(os.getpid(),)), 10,
                   message="the stranger's buffer let go by the daemon")


def pwd_uid(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid


# -- crashes and leaks ---------------------------------------------------------------------------

BIG = (64, 1024, 1024)  # 256 MiB of float32: far above any noise in Shmem
SHMEM_TOLERANCE_KIB = 96 * 1024

CLIENT_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from modelwarden.client.client import Client
    client = Client({endpoint!r})
    x = client.empty({shape!r}); x.fill_(2.0)
    future = client.submit("slow", x)   # in flight when we are killed
    print("ready", flush=True)
    future.result()
""")


def shmem_back(baseline: int) -> bool:
    return shmem_kib() <= baseline + SHMEM_TOLERANCE_KIB


def nobody_but_us_holds_buffers() -> bool:
    return not memfd_holders(exclude=(os.getpid(),))


def test_no_leaks_after_sigkill_of_a_client_a_worker_and_the_supervisor():
    slow = echo("slow", copy=False, workers=2, kwargs={"copy": False, "delay": 1.0})
    with Daemon([slow], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        baseline = shmem_kib()

        # 1. a client SIGKILLed mid-request: nothing of its buffers survives anywhere
        script = CLIENT_SCRIPT.format(root=str(ROOT), endpoint=daemon.endpoint, shape=BIG)
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert readline_within(child.stdout).strip() == "ready"
        poll_until(lambda: any(w["inflight"] for w in daemon.workers()), 10, message="in flight")
        holders = memfd_holders()
        assert child.pid in holders and daemon.process.pid in holders
        assert shmem_kib() > baseline + 200 * 1024
        child.kill()
        child.wait()
        poll_until(nobody_but_us_holds_buffers, 20, message="no process holding the dead client's buffers")
        poll_until(lambda: shmem_back(baseline), 20, message=f"Shmem back to {baseline} kB")

        # 2. a worker SIGKILLed mid-request: the retry runs on the other one; nothing leaks
        with Client(daemon.endpoint) as client:
            x = client.empty(BIG)
            x.fill_(3.0)
            future = client.submit("slow", x)
            busy = poll_until(lambda: next((w for w in daemon.workers() if w["inflight"]), None), 10,
                              message="a worker holding the request")
            os.kill(busy["pid"], signal.SIGKILL)
            assert future.result(timeout=60).data_ptr() == x.data_ptr()
            del future
            assert torch.all(client.infer("slow", x, timeout=60) == 3.0)
            del x
        poll_until(nobody_but_us_holds_buffers, 20, message="no process holding buffers")
        assert not memfd_holders().get(os.getpid())
        poll_until(lambda: shmem_back(baseline), 20, message=f"Shmem back to {baseline} kB")

        # 3. the supervisor SIGKILLed mid-request: its workers die with it, the client lets go
        poll_until(lambda: len(daemon.workers(state="READY")) == 2, 60, message="both READY")
        workers = daemon.worker_pids()
        client = Client(daemon.endpoint)
        try:
            x = client.empty(BIG)
            x.fill_(4.0)
            future = client.submit("slow", x, timeout=5)
            poll_until(lambda: any(w["inflight"] for w in daemon.workers()), 10, message="in flight")
            os.kill(daemon.process.pid, signal.SIGKILL)
            daemon.process.wait()
            with pytest.raises(Exception):
                future.result(timeout=30)
            poll_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), 15,
                       message="the workers gone with their supervisor")
            assert nobody_but_us_holds_buffers()
        finally:
            client.close()
        del x, future
        assert not memfd_holders().get(os.getpid())
        poll_until(lambda: shmem_back(baseline), 20, message=f"Shmem back to {baseline} kB")


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

    from modelwarden.client.client import AsyncClient

    with Daemon([echo("fresh", copy=True)], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        x = sample(torch.float32, (64, 64))
        client = Client(daemon.endpoint)
        try:
            made = client.empty((64, 64))
            made.copy_(x)
            assert same_bytes(client.infer("fresh", made), x)
            assert same_bytes(client.submit("fresh", x).result(timeout=30), x)
            old = set(client._session.arena.tokens())
            assert daemon.stop() == 0
            daemon.start()  # a new daemon knows none of this client's tokens
            daemon.wait_ready()
            assert same_bytes(client.infer("fresh", made), x)  # registers again and resends
            assert not old & set(client._session.arena.tokens())  # new tokens
            assert same_bytes(client.infer("fresh", x), x)
            assert same_bytes(client.submit("fresh", made).result(timeout=30), x)
            bigger = sample(torch.float32, (256, 256))  # a new buffer, registered at once
            assert same_bytes(client.infer("fresh", bigger), bigger)

            async def use_async():
                async with AsyncClient(daemon.endpoint) as async_client:
                    return await async_client.infer("fresh", x)

            assert same_bytes(asyncio.run(use_async()), x)
        finally:
            client.close()


def test_a_new_buffer_after_a_daemon_restart_reregisters_the_old_ones_too():
    with Daemon([echo("fresh", copy=True)], daemon={"shm_threshold": THRESHOLD}) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            made = client.empty((64, 64))
            made.fill_(5.0)
            assert torch.all(client.infer("fresh", made) == 5.0)
            assert daemon.stop() == 0
            daemon.start()
            daemon.wait_ready()
            big = client.empty((512, 512))  # registering it finds the channel dead: renews all
            big.fill_(6.0)
            assert torch.all(client.infer("fresh", big) == 6.0)
            assert torch.all(client.infer("fresh", made) == 5.0)
