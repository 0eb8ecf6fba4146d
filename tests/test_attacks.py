"""A member of the clients' group attacks the daemon's descriptors and memory; the daemon keeps
serving everyone else (issue 21; docs/ARCHITECTURE.md, "Budgets and shares").

The attacker is a real user made here, in the daemon's ``shm_group``, running tests/attacks.py
(standard library only) under the system python through setpriv. The daemon runs at a low
``RLIMIT_NOFILE`` so that each flood reaches the limits in a few seconds; every flood is bounded
in count. Each test asserts that the supervisor stays under its descriptor limit, that the
attacker got typed refusals or shut connections, and that another user (the test, root) is
served with correct answers throughout.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys


import numpy as np
import pytest
import torch

from modelwarden import Client
from modelwarden.client.client import control_request
from modelwarden.supervisor.routing import localfront
from tests.helpers import (ROOT, Daemon, fd_count, mlp_model, poll_until, readline_within,
                           rss_bytes, temporary_user)

NOFILE = 1024
ATTACKS = (ROOT / "tests" / "attacks.py").read_text()
MiB = 1 << 20


@pytest.fixture(scope="module")
def member():
    """(user, group): an unprivileged user whose group is the daemon's shm_group."""
    if os.geteuid() != 0:
        pytest.skip("creates a user and a group: needs root")
    if shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs setpriv and a system /usr/bin/python3")
    with temporary_user("mwatk") as (user, group):
        yield user, group


def _many_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))  # the attacker's own, not the daemon's


@contextlib.contextmanager
def attack(member, *argv: str):
    """Run one attack as the member; yield what it reports once its flood is done, hold its
    connections open until the block ends."""
    user, group = member
    process = subprocess.Popen(
        ["setpriv", "--reuid", user, "--regid", group, "--init-groups", "/usr/bin/python3", "-c",
         ATTACKS, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd="/", preexec_fn=_many_descriptors)
    try:
        line = readline_within(process.stdout, timeout=90)
        assert line, process.stderr.read()
        yield json.loads(line)
    finally:
        process.stdin.close()
        process.wait(30)


def member_uid(member) -> int:
    import pwd

    return pwd.getpwnam(member[0]).pw_uid


def held_by(daemon: Daemon, uid: int) -> dict:
    rows = daemon.status()["daemon"]["identities"]
    return next((row for row in rows if row["identity"] == f"uid:{uid}"),
                {"connections": 0, "buffers": 0, "buffer_bytes": 0})


def shared_daemon(member, models=None, local: bool = False, **daemon) -> Daemon:
    settings = {"shm_group": member[1], **daemon}
    started = Daemon(models or [mlp_model(workers=1, warmup=0)], daemon=settings, nofile=NOFILE,
                     local=local)
    return started


def open_to_group(daemon: Daemon) -> None:
    os.chmod(daemon.dir, 0o711)  # mkdtemp made it 0700; run/ inside is 0750 for the group


def assert_serves(daemon: Daemon, shm: bool = False) -> None:
    """Root's requests get correct answers (a fresh client: a new connection is accepted)."""
    x = torch.arange(64 * 4096, dtype=torch.float32).reshape(4096, 64) / 1e5
    with Client(daemon.endpoint, timeout=20, shm=shm) as client:
        first = client.infer("mlp", x)
        assert first.shape == (4096, 10) and torch.equal(first, client.infer("mlp", x))


def assert_within_descriptors(daemon: Daemon) -> None:
    limits = daemon.status()["daemon"]["limits"]
    assert fd_count(daemon.process.pid) < NOFILE - limits["fd_reserve"] // 2, limits


# "share": the member's connections past its share are shut; "pause": with a share as large as
# the whole account (as many identities together would have), pausing every listener is what
# keeps the table from filling.
FLOOD_GUARDS = {"share": {}, "pause": {"max_connections_per_identity": 100_000}}


@pytest.mark.slow
@pytest.mark.parametrize("guard", FLOOD_GUARDS)
def test_a_control_sock_flood_is_paused_and_shut_and_never_aborts_the_supervisor(member, guard):
    with shared_daemon(member, **FLOOD_GUARDS[guard]) as daemon:
        daemon.wait_ready()
        open_to_group(daemon)
        control = str(daemon.dir / "run" / "control.sock")
        with Client(daemon.endpoint, timeout=20, shm=False) as connected:
            connected.infer("mlp", np.ones((1, 64), np.float32))
            with attack(member, "connect", control, "3000") as found:
                assert daemon.process.poll() is None, daemon.log()[-3000:]
                limits = daemon.status()["daemon"]["limits"]
                kept = found["connected"] - found["closed_by_daemon"]
                assert found["closed_by_daemon"] > 0 or found["refused"], found
                if guard == "share":
                    # Every connection past the member's share was closed as it was accepted.
                    share = limits["per_identity"]["connections"]
                    assert kept <= share, found
                    assert held_by(daemon, member_uid(member))["connections"] <= share
                    assert_within_descriptors(daemon)
                else:
                    # The listeners paused at the mark (the file renamed aside: ENOENT; the loop
                    # accepts control.sock itself, so nothing is accepted behind its back).
                    assert kept <= limits["max_connections"] + localfront.BACKLOG, found
                    assert fd_count(daemon.process.pid) < NOFILE
                assert connected.infer("mlp", np.ones((1, 64), np.float32)).shape == (1, 10)
                # The operator's status goes to the admin socket, which is never paused.
                cli = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--json",
                                      "--config", str(daemon.config_path)], capture_output=True,
                                     text=True, timeout=60, cwd=ROOT)
                assert cli.returncode == 0, cli.stderr
                assert json.loads(cli.stdout)["daemon"]["pid"] == daemon.process.pid
            poll_until(lambda: control_request(daemon.control, {"type": "status"}, 2.0), 60,
                       message="control.sock answers again")
        assert_serves(daemon)
        log = daemon.log()
        assert "Too many open files" not in log
        if guard == "share":
            refused = "control.sock: refused "
            assert refused in log and "connection(s) from uid" in log
            assert log.count(refused) < 5  # once a minute per uid, with a count
        else:
            assert "new connections paused on" in log and "control.sock" in log


@pytest.mark.slow
@pytest.mark.parametrize("guard", FLOOD_GUARDS)
def test_a_local_frontend_flood_is_shut_past_its_share_or_paused_and_others_are_served(member, guard):
    """unix:// (supervisor/routing/localfront.py): the loop accepts there itself, so a
    connection past the member's share is accepted and closed at once; at the high-water mark
    the listener leaves the poller and what connects waits in the kernel's backlog."""
    with shared_daemon(member, local=True, **FLOOD_GUARDS[guard]) as daemon:
        daemon.wait_ready()
        open_to_group(daemon)
        x = np.ones((1, 64), np.float32)
        with Client(daemon.local, timeout=20, shm=False) as connected:
            want = connected.infer("mlp", x)
            # share: blocking connects, each reaches the daemon's accept; pause: non-blocking
            # ones, refused EAGAIN once the listener has left the poller and its backlog is full.
            flood = "streams" if guard == "share" else "connect"
            with attack(member, flood, daemon.local[len("unix://"):], "1100") as found:
                assert daemon.process.poll() is None, daemon.log()[-3000:]
                limits = daemon.status()["daemon"]["limits"]
                kept = found["connected"] - found["closed_by_daemon"]
                if guard == "share":
                    share = limits["per_identity"]["connections"]
                    assert kept <= share and found["closed_by_daemon"] > 0, found
                    assert held_by(daemon, member_uid(member))["connections"] <= share
                else:
                    # Paused at the mark: what connected since waits in the kernel's backlog and
                    # holds no descriptor of the daemon's; the rest were refused.
                    assert found["refused"].get("EAGAIN"), found
                    assert kept <= limits["max_connections"] + localfront.BACKLOG, found
                assert_within_descriptors(daemon)
                assert np.array_equal(connected.infer("mlp", x), want)  # served throughout
        assert_serves_locally(daemon)  # a new connection is accepted once the member has left
        log = daemon.log()
        assert "Too many open files" not in log
        if guard == "share":
            refused = "local.sock: refused "
            assert refused in log and "connection(s) from uid" in log
            assert log.count(refused) < 5  # once a minute per uid, with a count
        else:
            assert "new connections paused on" in log and "local.sock" in log


def assert_serves_locally(daemon: Daemon) -> None:
    x = torch.arange(64 * 8, dtype=torch.float32).reshape(8, 64) / 1e3
    with Client(daemon.endpoint, timeout=20) as ipc:
        want = ipc.infer("mlp", x)
    with Client(daemon.local, timeout=20) as local:
        assert torch.equal(local.infer("mlp", x), want)


@pytest.mark.slow
def test_a_buffers_sock_descriptor_flood_gets_typed_refusals_within_a_share(member):
    with shared_daemon(member) as daemon:
        daemon.wait_ready()
        open_to_group(daemon)
        channel = str(daemon.dir / "run" / "buffers.sock")
        # One 4 KiB memfd, 64 times a message, 300 messages: 19,200 registrations asked for.
        with attack(member, "register", channel, "64", "300", "4096") as found:
            assert daemon.process.poll() is None, daemon.log()[-3000:]
            share = daemon.status()["daemon"]["limits"]["per_identity"]["buffers"]
            assert 0 < found["tokens"] <= share, found
            assert set(found["codes"]) == {"OVERLOADED"}, found
            assert any("max_buffers_per_identity" in text or "descriptor budget" in text
                       for text in found["messages"]), found
            assert held_by(daemon, member_uid(member))["buffers"] == found["tokens"]
            assert_within_descriptors(daemon)
            assert_serves(daemon, shm=True)  # root's buffers are registered and used
        poll_until(lambda: held_by(daemon, member_uid(member))["buffers"] == 0, 30,
                   message="the member's buffers revoked with its connection")
        assert "Too many open files" not in daemon.log()


@pytest.mark.slow
def test_a_channel_connection_fill_by_one_uid_leaves_room_for_others(member):
    with shared_daemon(member) as daemon:
        daemon.wait_ready()
        open_to_group(daemon)
        channel = str(daemon.dir / "run" / "buffers.sock")
        with attack(member, "channels", channel, "1100") as found:
            share = daemon.status()["daemon"]["limits"]["per_identity"]["connections"]
            kept = found["connected"] - found["closed_by_daemon"]
            # Past its share the daemon accepted and shut them: the member's connects waited in
            # the backlog for the daemon's accept, whatever the daemon's speed.
            assert kept <= share and found["closed_by_daemon"] > 0, found
            assert held_by(daemon, member_uid(member))["connections"] <= share
            assert_within_descriptors(daemon)
            assert_serves(daemon, shm=True)  # root's channel connection is accepted
        log = daemon.log()
        assert "buffer channel: refused" in log and log.count("buffer channel: refused") < 5


def test_huge_and_sparse_memfds_cost_the_daemon_no_more_than_a_share(member):
    limits = {"max_buffer_bytes": 2048 * MiB, "max_shm_tensor_bytes": 64 * MiB}
    with shared_daemon(member, **limits) as daemon:
        daemon.wait_ready()
        open_to_group(daemon)
        channel = str(daemon.dir / "run" / "buffers.sock")
        share = daemon.status()["daemon"]["limits"]["per_identity"]["buffer_bytes"]
        assert share == 512 * MiB  # a quarter of max_buffer_bytes
        supervisor_before = rss_bytes(daemon.process.pid)
        with attack(member, "register", channel, "1", "1", str(1 << 40), "sparse") as found:
            assert found["tokens"] == 0 and found["codes"] == {"BAD_REQUEST": 1}, found
            assert "max_buffer_bytes_per_identity" in found["messages"][0]
        # 240 sparse 256 MiB memfds: the first two fit the member's 512 MiB share.
        with attack(member, "register", channel, "1", "240", str(256 * MiB), "sparse") as found:
            assert found["tokens"] == 2 and found["codes"] == {"OVERLOADED": 238}, found
            assert held_by(daemon, member_uid(member))["buffer_bytes"] == 512 * MiB
            assert_serves(daemon, shm=True)  # another user's shared memory still works
            # The supervisor never maps a buffer: 240 sparse 256 MiB memfds cost it nothing.
            assert rss_bytes(daemon.process.pid) - supervisor_before < 32 * MiB


def test_a_shared_memory_tensor_past_its_byte_limit_is_refused_before_a_worker_maps_it():
    from tests.test_shm import RawChannel, RawConnection, infer_on  # the spec's raw clients

    limits = {"max_shm_tensor_bytes": 64 * MiB, "max_shm_request_bytes": 96 * MiB}
    with Daemon([{"name": "alias", "source": "python:tests.faulty:make_echo", "workers": 1,
                  "warmup": 0, "kwargs": {"copy": True}}], daemon=limits) as daemon:
        daemon.wait_ready()
        (worker,) = daemon.worker_pids()
        before = rss_bytes(worker)
        fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 30)  # 1 GiB, never written: it costs us nothing
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        channel, connection = RawChannel(str(daemon.dir / "run" / "buffers.sock")), RawConnection(daemon.endpoint)
        try:
            (token,) = channel.register(fd)
            whole = connection.request(infer_on(token, 0, 1 << 30))
            assert not whole["ok"] and whole["error"]["code"] == "BAD_REQUEST"
            assert "max_shm_tensor_bytes (67108864)" in whole["error"]["message"], whole
            served = connection.request(infer_on(token, 0, 32 * MiB))
            assert served["ok"], served
            # The worker faulted in (and copied) what the request named, not the buffer's 1 GiB.
            assert rss_bytes(worker) - before < 4 * 32 * MiB
        finally:
            connection.close()
            channel.close()
            os.close(fd)
