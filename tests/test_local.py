"""The local frontend (``unix://``, supervisor/routing/localfront.py; client/local.py): the real
daemon, real worker processes, real Unix sockets. It serves what an ``ipc://`` frontend serves,
with the same answers; what a client may send it, make it hold or make it do is bounded as on
the ZeroMQ frontends; a daemon that goes away fails what waited on it at once."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from modelwarden import (AsyncClient, BadInput, Client, ConnectionLost, NoDaemon, UnknownModel,
                         connect)
from modelwarden.shared import protocol
from modelwarden.shared.config import check_endpoint
from modelwarden.shared.link import Link, frame_prefix
from modelwarden.supervisor.routing.limits import MAX_FRAMES
from tests.helpers import ROOT, Daemon, mlp_model, poll_until


@pytest.fixture(scope="module")
def daemon():
    with Daemon([mlp_model("mlp", workers=1)], local=True) as started:
        started.wait_ready()
        yield started


def local_path(daemon: Daemon) -> str:
    return daemon.local[len("unix://"):]


def raw_connection(daemon: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(local_path(daemon))
    return sock


def framed(parts: list) -> bytes:
    return frame_prefix(parts) + b"".join(parts)


def infer_parts(request_id: int, x: np.ndarray, model: str = "mlp") -> list:
    header = {"type": "infer", "id": request_id, "model": model, "inputs": 0,
              "tensors": [{"dtype": str(x.dtype), "shape": list(x.shape), "frame": 0}]}
    return [protocol.SIGNATURE, protocol.pack(header), x.tobytes()]


def replies_on(link: Link, count: int, timeout: float = 30.0) -> list[dict]:
    """The headers of the next ``count`` messages the daemon writes on ``link``."""
    headers: list[dict] = []

    def got_all() -> bool:
        if select.select([link.fd], [], [], 0.05)[0]:
            headers.extend(protocol.unpack_header(parts[1]) for parts in link.receive())
        return len(headers) >= count

    poll_until(got_all, timeout, message=f"{count} replies")
    return headers


def closed_by_daemon(sock: socket.socket, timeout: float = 15.0) -> bool:
    def closed():
        try:
            return sock.recv(65536, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    poll_until(closed, timeout, message="the daemon to close the connection")
    return True


def cpu_seconds(pid: int) -> float:
    """User + system time of every thread of ``pid`` so far (/proc/PID/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_connections(daemon: Daemon) -> int:
    rows = daemon.status()["daemon"]["identities"]
    return next((row["connections"] for row in rows if row["identity"] == f"uid:{os.geteuid()}"), 0)


# -- served as on ipc ----------------------------------------------------------------------------


def test_a_local_client_gets_what_an_ipc_client_gets_sync_submit_and_async(daemon):
    small, large = torch.randn(3, 64), torch.randn(4096, 64)  # large: 1 MiB, in shared memory
    with Client(daemon.endpoint, timeout=30) as ipc:
        expected = [ipc.infer("mlp", x) for x in (small, large)]
    with Client(daemon.local, timeout=30) as local:
        assert local.hello()["shm"]["enabled"]
        for x, want in zip((small, large), expected):
            assert torch.equal(local.infer("mlp", x), want)
        futures = [local.submit("mlp", small) for _ in range(64)]
        assert all(torch.equal(future.result(30), expected[0]) for future in futures)
        with pytest.raises(UnknownModel):
            local.infer("nope", small)
        with pytest.raises(BadInput):
            local.infer("mlp", torch.randn(3, 5))
    with Client(daemon.local, timeout=30, shm=False) as inline:
        assert torch.equal(inline.infer("mlp", large), expected[1])  # 1 MiB in the link's frames

    async def many() -> list:
        async with AsyncClient(daemon.local, timeout=30) as client:
            return await asyncio.gather(*[client.infer("mlp", small) for _ in range(128)])

    assert all(torch.equal(out, expected[0]) for out in asyncio.run(many()))


@pytest.mark.parametrize("frontend", ["local", "endpoint"])  # unix://, and ipc:// (ZMTP)
def test_a_local_connection_is_its_uids_until_it_closes(daemon, frontend):
    before = own_connections(daemon)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(getattr(daemon, frontend).partition("://")[2])
    try:
        poll_until(lambda: own_connections(daemon) == before + 1, 15,
                   message="the connection counted as ours")
    finally:
        sock.close()
    poll_until(lambda: own_connections(daemon) == before, 15, message="given back at its close")


# -- bad bytes -----------------------------------------------------------------------------------


def test_bad_messages_in_good_frames_get_typed_errors_on_a_connection_that_stays(daemon):
    link = Link(raw_connection(daemon))
    try:
        x = np.ones((2, 64), np.float32)
        link.send([b"not the signature", b"\x80"], blocking=True)
        link.send([protocol.SIGNATURE, b"\xc1"], blocking=True)  # 0xc1: never valid msgpack
        link.send(infer_parts(7, np.ones((2, 5), np.float32)), blocking=True)
        first, second, third = replies_on(link, 3)
        for reply in (first, second):
            assert reply["ok"] is False and reply["error"]["code"] == protocol.BAD_REQUEST, reply
        assert third["error"]["code"] == protocol.BAD_INPUT and third["id"] == 7, third
        link.send(infer_parts(8, x), blocking=True)
        [answer] = replies_on(link, 1)
        assert answer["ok"] is True and answer["id"] == 8, answer
    finally:
        link.close()


GARBAGE = {"no parts": struct.pack("<I", 0),
           "more parts than a message has frames": struct.pack("<I", MAX_FRAMES + 1) + bytes(8),
           "more bytes than max_message_bytes": struct.pack("<IQ", 1, 1 << 50)}


@pytest.mark.parametrize("garbage", GARBAGE)
def test_a_connection_that_frames_garbage_is_closed_alone(daemon, garbage):
    with Client(daemon.local, timeout=30) as bystander:
        x = torch.randn(2, 64)
        want = bystander.infer("mlp", x)
        sock = raw_connection(daemon)
        try:
            sock.sendall(GARBAGE[garbage])
            assert closed_by_daemon(sock)
        finally:
            sock.close()
        assert torch.equal(bystander.infer("mlp", x), want)  # its connection was not touched
    # once a minute per uid: the first of these tests logs it, the others are counted for later
    assert f"local.sock: closed 1 connection(s) from uid {os.geteuid()}" in daemon.log()


# -- what a client can make the daemon hold --------------------------------------------------------


def test_a_client_that_never_reads_is_not_read_either_and_each_request_it_sent_is_answered(daemon):
    """Its replies fill its socket, then wait in the daemon's queue for it; meanwhile the
    daemon reads nothing more of it, so its requests stop at its own socket's buffer and it
    cannot make the daemon hold more (unbounded, an error reply for each request past the
    queue would wait for it). Once it reads, every request it sent is answered once."""
    sock = raw_connection(daemon)
    sock.setblocking(False)
    x = np.ones((4, 64), np.float32)  # 1 KiB
    sent, rest = 0, b""
    try:
        while sent < 50_000 or rest:
            # Two seconds without room in the socket: the daemon has stopped reading it.
            if not select.select([], [sock], [], 2.0)[1]:
                break
            if not rest:
                rest = framed(infer_parts(sent + 1, x))
                sent += 1
            rest = rest[sock.send(rest):]
        assert sent < 50_000, "the daemon kept reading a client that reads none of its replies"
        # Everyone else is served meanwhile, and the silent connection is not polled for reading
        # either: a level-triggered poll would wake the loop at once, for ever. The bystander's
        # 1,000 round trips are the window: the supervisor spends a fraction of it, not all.
        with Client(daemon.local, timeout=30) as bystander:
            assert bystander.infer("mlp", torch.ones(1, 64)).shape == (1, 10)
            cpu, wall = cpu_seconds(daemon.process.pid), time.monotonic()
            for _ in range(1000):
                bystander.infer("mlp", torch.ones(1, 64))
            busy = (cpu_seconds(daemon.process.pid) - cpu) / (time.monotonic() - wall)
        assert busy < 0.8, f"the supervisor's loop spins ({busy:.0%} of a core)"
        ids = read_all_while_writing(sock, rest, sent)
    finally:
        sock.close()
    assert sorted(ids) == list(range(1, sent + 1))  # each once


def read_all_while_writing(sock: socket.socket, rest: bytes, count: int) -> list:
    """The ids of ``count`` replies read from ``sock``, while ``rest`` is written to it."""
    data, ids = bytearray(), []
    deadline = time.monotonic() + 120
    while len(ids) < count:
        assert time.monotonic() < deadline, f"{len(ids)} of {count} replies"
        readable, writable, _ = select.select([sock], [sock] if rest else [], [], 1.0)
        if writable:
            rest = rest[sock.send(rest):]
        if readable:
            chunk = sock.recv(1 << 20)
            assert chunk, "the daemon closed the connection"
            data += chunk
            ids += [protocol.unpack_header(parts[1])["id"] for parts in split_frames(data)]
    return ids


def split_frames(data: bytearray) -> list[list[bytes]]:
    """The whole link messages at the start of ``data``, removed from it."""
    messages = []
    while len(data) >= 4:
        count = struct.unpack_from("<I", data)[0]
        head = 4 + 8 * count
        if len(data) < head:
            break
        lengths = struct.unpack_from(f"<{count}Q", data, 4)
        if len(data) < head + sum(lengths):
            break
        parts, at = [], head
        for length in lengths:
            parts.append(bytes(data[at:at + length]))
            at += length
        messages.append(parts)
        del data[:at]
    return messages


# -- a daemon that goes away, or is not there ------------------------------------------------------


@pytest.mark.parametrize("frontend", ["local", "endpoint"])  # unix://, and ipc:// (ZMTP)
def test_a_daemon_that_dies_fails_what_waited_on_it_at_once_and_its_restart_is_connected_again(frontend):
    # Slow enough that none of the six requests is answered before the kill, however slowly
    # the threads below start.
    echo = {"name": "echo", "source": "python:tests.faulty:make_echo", "kwargs": {"delay": 5.0},
            "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 0}
    x = torch.arange(8.0)
    with Daemon([echo], local=True) as daemon:
        daemon.wait_ready()
        endpoint = getattr(daemon, frontend)
        with Client(endpoint, timeout=120) as client:
            client.hello()
            futures = [client.submit("echo", x) for _ in range(4)]
            outcome: dict = {}

            def sync_infer() -> None:
                try:
                    outcome["sync"] = client.infer("echo", x)
                except BaseException as exc:
                    outcome["sync"] = exc

            async def async_infer() -> None:
                async with AsyncClient(endpoint, timeout=120) as other:
                    await other.hello()
                    try:
                        outcome["async"] = await other.infer("echo", x)
                    except BaseException as exc:
                        outcome["async"] = exc

            threads = [threading.Thread(target=sync_infer),
                       threading.Thread(target=asyncio.run, args=(async_infer(),))]
            for thread in threads:
                thread.start()
            poll_until(lambda: daemon.status()["daemon"]["pending"] == 6, 30,
                       message="all six requests held by the daemon")
            daemon.process.kill()
            daemon.process.wait(30)
            for future in futures:  # well before their 120 s deadline
                assert isinstance(future.exception(30), ConnectionLost)
            for thread in threads:
                thread.join(30)
            assert isinstance(outcome["sync"], ConnectionLost), outcome
            assert isinstance(outcome["async"], ConnectionLost), outcome
            daemon.start()
            daemon.wait_ready()
            submitted = client.submit("echo", x)  # the same client, connected again, both ways
            assert torch.equal(client.infer("echo", x), x)
            assert torch.equal(submitted.result(60), x)


def test_the_cli_says_a_daemon_that_died_with_its_request_is_unreachable(tmp_path):
    """``modelwarden infer`` on unix://: exit 3 and the reason, not a traceback."""
    hang = {"name": "echo", "source": "python:tests.faulty:make_echo", "kwargs": {"delay": 60.0},
            "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 0}
    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.float32))
    with Daemon([hang], local=True) as daemon:
        daemon.wait_ready()
        cli = subprocess.Popen([sys.executable, "-m", "modelwarden", "infer", "echo", "--endpoint",
                                daemon.local, "--input", str(tmp_path / "x.npy"), "--timeout", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            poll_until(lambda: daemon.status()["daemon"]["pending"] == 1, 60,
                       message="the CLI's request held by the daemon")
            daemon.process.kill()
            daemon.process.wait(30)
            _, err = cli.communicate(timeout=60)
        finally:
            cli.kill()
        assert cli.returncode == 3, err
        assert "closed the connection before it answered" in err and "Traceback" not in err


def test_no_daemon_at_a_local_endpoint_is_no_daemon_once_the_timeout_has_passed(tmp_path):
    endpoint = f"unix://{tmp_path}/none.sock"
    with Client(endpoint, timeout=0.3) as client:
        with pytest.raises(NoDaemon, match="no daemon listening at"):
            client.infer("mlp", torch.zeros(1, 64))

    async def once() -> None:
        async with AsyncClient(endpoint, timeout=0.3) as client:
            await client.infer("mlp", torch.zeros(1, 64))

    with pytest.raises(NoDaemon, match="no daemon listening at"):
        asyncio.run(once())


def test_a_local_endpoint_is_one_daemons_and_an_absolute_path(tmp_path):
    with pytest.raises(ValueError, match="a unix:// endpoint is one daemon's"):
        connect([f"unix://{tmp_path}/a.sock", "tcp://127.0.0.1:1"])
    assert check_endpoint("unix:///run/modelwarden/local.sock")
    with pytest.raises(ValueError, match="unix:///ABSOLUTE/PATH"):
        check_endpoint("unix://relative.sock")


def test_with_no_frontend_configured_the_daemon_serves_both_and_a_client_of_its_config_goes_local(
        monkeypatch):
    """No ``[daemon] frontend``: ZeroMQ at RUNTIME/frontend.sock and the local frontend at
    RUNTIME/local.sock, and a client given only MODELWARDEN_CONFIG takes the local one, with
    the ipc client's answer. The local socket a killed daemon leaves is removed by the next
    daemon on that directory when it serves none there (a client would try it first)."""
    x = torch.randn(3, 64)
    with Daemon([mlp_model("mlp", workers=1)], default_frontends=True) as daemon:
        daemon.wait_ready()
        run = daemon.dir / "run"
        ipc, unix = f"ipc://{run}/frontend.sock", f"unix://{run}/local.sock"
        assert daemon.status()["daemon"]["endpoints"]["frontend"] == [ipc, unix]
        assert stat.S_IMODE(os.lstat(run / "local.sock").st_mode) == 0o600
        monkeypatch.setenv("MODELWARDEN_CONFIG", str(daemon.config_path))
        monkeypatch.delenv("MODELWARDEN_ENDPOINT", raising=False)
        with Client(timeout=30) as local, Client(ipc, timeout=30) as zeromq:
            assert local.endpoint == unix
            torch.testing.assert_close(local.infer("mlp", x), zeromq.infer("mlp", x))
        monkeypatch.delenv("MODELWARDEN_CONFIG")
        daemon.process.kill()
        daemon.process.wait(30)
        assert stat.S_ISSOCK(os.lstat(run / "local.sock").st_mode)  # left behind
        with Daemon([mlp_model("mlp", workers=1)], daemon={"runtime_dir": str(run)}) as again:
            again.wait_ready()
            frontends = again.status()["daemon"]["endpoints"]["frontend"]
            assert [endpoint[:6] for endpoint in frontends] == ["ipc://"]
            assert not os.path.lexists(run / "local.sock")
