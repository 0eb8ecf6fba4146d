"""Privilege separation: who can reach which socket, workers bound to their spawn secret, and a
runtime directory that is checked, never repaired (docs/ARCHITECTURE.md, "Trust boundary").

The integration tests start the real daemon as root (the test runner) and act as a real
unprivileged user, created here, through setpriv.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from modelwarden.shared import protocol, rawconfig, trustdir
from modelwarden.client.client import Client, control_request
from modelwarden.shared.config import load_settings
from modelwarden.client.ipcaccess import NoDaemon
from modelwarden.client.session import Session
from modelwarden.shared.states import WorkerState
from modelwarden.supervisor import runtime
from modelwarden.supervisor.arbiter import Arbiter
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.shared.process import DaemonError
from modelwarden.supervisor.fleet.workerauth import WARN_EVERY_S, WorkerGate
from modelwarden.shared.link import Link
from tests.helpers import ROOT, Daemon, mlp_model, poll_until, render_config, temporary_user

EXIT_DAEMON_ERROR = 1  # modelwarden/cli.py: a DaemonError (runtime directory, lock, endpoint)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates a user and a group: needs root")


# -- a real unprivileged user in a real group -----------------------------------------------------


@pytest.fixture(scope="module")
def outsider():
    """(user, group): a fresh group and a user whose primary group it is; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creates a user and a group: needs root")
    if shutil.which("setpriv") is None or shutil.which("useradd") is None:
        pytest.skip("needs setpriv and useradd")
    with temporary_user("mw") as (user, group):
        yield user, group


def _reachable_by_all(path: Path) -> bool:
    return all(os.stat(part).st_mode & stat.S_IXOTH for part in path.parents)


def _python_for_others() -> str:
    """An interpreter an unprivileged user may execute: ours, or a system one of the same
    version (the test venv's interpreter may live under /root, mode 0700)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (sys.executable, shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and _reachable_by_all(Path(os.path.realpath(candidate))):
            return candidate
    pytest.skip("no python interpreter the test user may execute")


def run_as(user: str, group: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid", user, "--regid", group, "--init-groups", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp",
                               "LANG": "C.UTF-8"})


def test_a_group_member_serves_and_reads_but_cannot_command_or_impersonate(outsider):
    user, group = outsider
    site_packages = sysconfig.get_paths()["purelib"]
    if not _reachable_by_all(Path(site_packages) / "x") or not _reachable_by_all(ROOT / "tests" / "x"):
        pytest.skip(f"{site_packages} or {ROOT} is not readable by other users")
    with Daemon([mlp_model(workers=1)], daemon={"shm_group": group}, local=True) as daemon:
        os.chmod(daemon.dir, 0o755)  # mkdtemp made it 0700: let the user reach run/
        daemon.wait_ready()
        run_dir = daemon.dir / "run"
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o750
        assert os.stat(run_dir).st_gid == grp.getgrnam(group).gr_gid
        assert stat.S_IMODE(os.stat(run_dir / "private").st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(run_dir / "control.sock").st_mode) == 0o660
        assert stat.S_IMODE(os.lstat(run_dir / "local.sock").st_mode) == 0o660
        assert os.lstat(run_dir / "local.sock").st_gid == grp.getgrnam(group).gr_gid
        assert stat.S_IMODE(os.lstat(run_dir / "private" / "admin.sock").st_mode) == 0o600

        result = run_as(user, group, [_python_for_others(), "-I", "-S", str(ROOT / "tests" / "outsider.py"),
                                      site_packages, str(run_dir)])
        assert result.returncode == 0, result.stderr
        found = json.loads(result.stdout)

        assert found["uid"] == pwd.getpwnam(user).pw_uid
        assert found["infer_shape"] == [2, 10]
        assert found["local_infer_shape"] == [2, 10]  # unix://, as the member's own uid
        assert found["local_connection_counted_as_ours"]  # as the member's uid, not the daemon's
        assert found["status_ready"] == [1]
        assert found["cli_status"]["code"] == 0, found["cli_status"]
        for command in ("stop", "restart", "reload", "scale", "stop_target"):
            refusal = found[f"{command}_on_control"]
            assert refusal["code"] == protocol.BAD_REQUEST, refusal
            assert "only accepted on the admin socket" in refusal["message"]
        assert found["connect private/admin.sock"] == "PermissionError"
        assert found["client_on_admin"].startswith("PermissionError: permission denied: "), found
        assert "only the daemon's user (root) or root" in found["client_on_admin"]
        assert found["cli_stop"]["code"] == 3
        assert "permission denied: " in found["cli_stop"]["stderr"]
        assert "private/admin.sock" in found["cli_stop"]["stderr"]

        # Still serving, same worker, nothing restarted, scaled or stopped.
        assert daemon.process.poll() is None
        status = daemon.status()
        assert [w["restarts"] for w in status["workers"]] == [0]
        assert [w["state"] for w in status["workers"]] == ["READY"]
        with Client(daemon.endpoint) as client:
            assert client.infer("mlp", np.ones((1, 64), np.float32)).shape == (1, 10)


# -- the workers' links: no address, and the spawn secret first ----------------------------------


def _unix_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _unix_paths() -> dict[int, str]:
    """Every AF_UNIX socket of this network namespace: inode -> its path ("" when unnamed)."""
    paths = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        paths[int(fields[6])] = fields[7] if len(fields) > 7 else ""
    return paths


def test_a_worker_speaks_only_on_sockets_without_an_address():
    """Nothing a worker reads or writes has a name another process could connect to: its link
    and its buffer pair are socket pairs, and the daemon listens on nothing for workers."""
    with Daemon([mlp_model(workers=2)]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            assert client.infer("mlp", np.ones((1, 64), np.float32)).shape == (1, 10)
        assert sorted(os.listdir(daemon.dir / "run" / "private")) == ["admin.sock"]
        paths = _unix_paths()
        for worker in daemon.workers("mlp"):
            held = _unix_inodes(worker["pid"]) & set(paths)
            assert len(held) >= 2, held  # its link and its buffer pair, at least
            assert {paths[inode] for inode in held} == {""}, {i: paths[i] for i in held}


def _arbiter_with_one_handle(tmp_path: Path) -> tuple[Arbiter, WorkerHandle, Link]:
    """An Arbiter that has not started (no sockets bound) and a handle registered as if it had
    spawned it, with a real link: (arbiter, handle, the worker's end of the link)."""
    config = tmp_path / "modelwarden.toml"
    config.write_text(render_config({"runtime_dir": str(tmp_path / "run")},
                                    [mlp_model(workers=1)]))
    settings = load_settings(config)
    arbiter = Arbiter(settings)
    pool = arbiter.pools["mlp"]
    spec = arbiter.worker_spec(settings.models[0], 0, 1, pool.slots[0].placement)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    handle = WorkerHandle(spec, None, 12345, sentinel=-1, started_at=arbiter.clock(),
                          on_state=pool._on_state, last_seen=arbiter.clock(), link=Link(ours))
    pool.slots[0].current = handle
    return arbiter, handle, Link(theirs, writable=True)


def _say(arbiter: Arbiter, handle: WorkerHandle, worker_end: Link, *headers: dict) -> None:
    """Each header as a message on the worker's end of the link, then the supervisor's round."""
    for header in headers:
        worker_end.send([protocol.pack(header)], True)
    arbiter.intake.drain_link(handle)


def test_messages_count_only_after_the_right_secret_once(tmp_path, caplog):
    arbiter, handle, worker_end = _arbiter_with_one_handle(tmp_path)
    loading = {"type": "state", "state": "LOADING", "info": {}}
    try:
        with caplog.at_level("WARNING", logger="modelwarden.supervisor.fleet.workerauth"):
            _say(arbiter, handle, worker_end, loading)
            assert handle.state == WorkerState.STARTING  # no hello yet
            _say(arbiter, handle, worker_end, {"type": "hello", "secret": b"x" * 32},
                 {"type": "hello", "secret": "not bytes"}, loading)
            assert handle.state == WorkerState.STARTING and not handle.authenticated
            assert arbiter.gate.refused == 4
            _say(arbiter, handle, worker_end, {"type": "hello", "secret": handle.spec.secret})
            assert handle.authenticated
            _say(arbiter, handle, worker_end, loading)
            assert handle.state == WorkerState.LOADING
            _say(arbiter, handle, worker_end, {"type": "hello", "secret": handle.spec.secret})
            assert arbiter.gate.refused == 5  # a second hello is refused
            worker_end.send([b"\xc1"], True)  # not msgpack
            arbiter.intake.drain_link(handle)
            assert arbiter.gate.refused == 6
        lines = [record.getMessage() for record in caplog.records]
        assert len(lines) == 1, lines  # rate-limited: one warning a minute per worker
        assert "mlp#0 pid 12345: dropping a message on its link" in lines[0]
        assert "x" * 32 not in caplog.text and repr(handle.spec.secret) not in caplog.text
        assert worker_end.receive() == []  # nothing was sent to it in answer
    finally:
        arbiter.context.term()


def test_secrets_are_random_and_kept_out_of_repr(tmp_path):
    arbiter, handle, _ = _arbiter_with_one_handle(tmp_path)
    try:
        specs = [arbiter.worker_spec(handle.spec.model, 0, 1, arbiter.pools["mlp"].slots[0].placement)
                 for _ in range(3)]
        assert len({spec.secret for spec in specs}) == 3
        assert all(len(spec.secret) == 32 for spec in specs)
        assert repr(specs[0].secret) not in repr(specs[0]) and "secret=" not in repr(specs[0])
    finally:
        arbiter.context.term()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Worker:
    def __init__(self, worker_id: str, pid: int) -> None:
        self.worker_id, self.pid = worker_id, pid


def test_gate_warns_once_a_minute_per_worker(caplog):
    clock = _Clock()
    gate = WorkerGate(clock)
    a, b = _Worker("mlp#0", 1), _Worker("mlp#1", 2)
    with caplog.at_level("WARNING", logger="modelwarden.supervisor.fleet.workerauth"):
        for _ in range(5):
            gate.refuse(a, "wrong secret")
        gate.refuse(b, "wrong secret")
        clock.now = WARN_EVERY_S + 1
        gate.refuse(a, "wrong secret")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3 and gate.refused == 7
    assert "4 more dropped in the last minute" in lines[2]


# -- the runtime directory: checked, never repaired -----------------------------------------------


def _boot_failure(tmp_path: Path, runtime_dir: Path, **daemon: str) -> subprocess.CompletedProcess:
    config = tmp_path / "modelwarden.toml"
    config.write_text(render_config({"runtime_dir": str(runtime_dir), **daemon}, []))
    return subprocess.run([sys.executable, "-m", "modelwarden", "serve", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_a_symlinked_runtime_dir_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    (tmp_path / "run").symlink_to(target)
    result = _boot_failure(tmp_path, tmp_path / "run")
    assert result.returncode == EXIT_DAEMON_ERROR
    assert f"runtime directory {tmp_path / 'run'}: is a symbolic link" in result.stderr
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755 and not list(target.iterdir())


def test_a_runtime_dir_with_a_wrong_mode_is_refused_not_chmodded(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    result = _boot_failure(tmp_path, run)
    assert result.returncode == EXIT_DAEMON_ERROR
    assert f"runtime directory {run}: has mode 0777, expected 0700" in result.stderr
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o777 and not list(run.iterdir())


def test_another_users_runtime_dir_is_refused(tmp_path, outsider):
    user, _ = outsider
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chmod(run, 0o700)
    os.chown(run, pwd.getpwnam(user).pw_uid, -1)
    result = _boot_failure(tmp_path, run)
    assert result.returncode == EXIT_DAEMON_ERROR
    assert f"runtime directory {run}: is owned by {user}" in result.stderr
    assert os.stat(run).st_uid == pwd.getpwnam(user).pw_uid and not list(run.iterdir())


def test_a_wide_private_dir_and_a_file_in_a_sockets_place_are_refused(tmp_path):
    run = tmp_path / "run"
    (run / "private").mkdir(parents=True)
    os.chmod(run, 0o700)
    os.chmod(run / "private", 0o755)
    result = _boot_failure(tmp_path, run)
    assert result.returncode == EXIT_DAEMON_ERROR
    assert f"runtime directory {run / 'private'}: has mode 0755, expected 0700" in result.stderr
    os.chmod(run / "private", 0o700)
    (run / "control.sock").write_text("not a socket")
    result = _boot_failure(tmp_path, run)
    assert result.returncode == EXIT_DAEMON_ERROR
    assert f"refusing to bind {run / 'control.sock'}: something that is not a socket" in result.stderr
    assert (run / "control.sock").read_text() == "not a socket"


def test_admin_must_be_private_ipc_and_there_is_no_backend_to_set(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o711)
    result = _boot_failure(tmp_path, tmp_path / "run", admin=f"ipc://{shared}/admin.sock")
    assert result.returncode == EXIT_DAEMON_ERROR
    assert "must lie in a directory only the daemon's user can enter" in result.stderr
    assert f"{shared} has mode 0711" in result.stderr
    result = _boot_failure(tmp_path, tmp_path / "run", backend="ipc:///tmp/backend.sock")
    assert result.returncode == 2 and "daemon.backend" in result.stderr
    assert "no backend endpoint" in result.stderr


def test_ensure_dir_creates_exactly_the_mode_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        runtime.ensure_dir(tmp_path / "a" / "run", 0o750, os.getegid())
    finally:
        os.umask(old)
    info = os.lstat(tmp_path / "a" / "run")
    assert stat.S_IMODE(info.st_mode) == 0o750 and info.st_gid == os.getegid()
    runtime.ensure_dir(tmp_path / "a" / "run", 0o750, os.getegid())  # as created: accepted
    with pytest.raises(DaemonError, match="has mode 0750, expected 0700"):
        runtime.ensure_dir(tmp_path / "a" / "run", 0o700, None)
    (tmp_path / "file").write_text("")
    with pytest.raises(DaemonError, match="is not a directory"):
        runtime.ensure_dir(tmp_path / "file", 0o700, None)


def test_control_socket_refuses_mutating_commands_from_anyone(tmp_path):
    """Even root on control.sock: the socket decides, not the caller (the CLI picks admin)."""
    with Daemon([mlp_model(workers=1)]) as daemon:
        daemon.wait_ready()
        with pytest.raises(Exception) as refused:
            control_request(daemon.control, {"type": "stop"}, 5.0)
        assert getattr(refused.value, "code", None) == protocol.BAD_REQUEST
        assert "private/admin.sock" in str(refused.value)
        assert control_request(daemon.admin, {"type": "status"})["status"]["daemon"]["stopping"] is False
        cli = subprocess.run([sys.executable, "-m", "modelwarden", "stop", "--admin", daemon.admin],
                             capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert cli.returncode == 0 and cli.stdout.strip() == "stopping"
        assert daemon.process.wait(30) == 0


# -- a client trusts only a runtime directory it can verify ---------------------------------------


@pytest.fixture(scope="module")
def victim():
    """A second real user: the one whose fallback directory the outsider squats."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("creates a user and a group, runs as them: needs root and setpriv")
    with temporary_user("mwv") as (user, group):
        yield user, group


def test_a_squatted_fallback_dir_is_refused_by_every_client_and_never_reached(outsider, victim):
    attacker, attacker_group = outsider
    user, group = victim
    site_packages = sysconfig.get_paths()["purelib"]
    if not _reachable_by_all(Path(site_packages) / "x") or not _reachable_by_all(ROOT / "tests" / "x"):
        pytest.skip(f"{site_packages} or {ROOT} is not readable by other users")
    python, script = _python_for_others(), str(ROOT / "tests" / "outsider.py")
    squat = Path(f"/tmp/modelwarden-{pwd.getpwnam(user).pw_uid}")
    if os.path.lexists(squat):
        pytest.skip(f"{squat} exists already")
    ready = squat / "listening"
    impostor = subprocess.Popen(["setpriv", "--reuid", attacker, "--regid", attacker_group,
                                 "--init-groups", python, "-I", "-S", script, "impostor",
                                 str(squat), str(ready)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        poll_until(lambda: ready.exists() or impostor.poll() is not None, 30,
                   message="the impostor listening")
        assert impostor.poll() is None, impostor.communicate()
        result = run_as(user, group, [python, "-I", "-S", script, "victim", site_packages])
    finally:
        impostor.terminate()
        seen, impostor_err = impostor.communicate(timeout=30)
        shutil.rmtree(squat, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    says = f"refusing {squat}: it is owned by {attacker} (uid {pwd.getpwnam(attacker).pw_uid})"
    for client in ("client", "async_client"):
        assert found[client].startswith(f"UntrustedRuntimeDir: {says}"), found[client]
        assert "\n" not in found[client]
    for command in ("cli_status", "cli_stop"):
        done = found[command]
        assert done["code"] == 3 and done["stdout"] == "", done
        assert done["stderr"].startswith(f"modelwarden: {says}") and done["stderr"].count("\n") == 1, done
    connections = json.loads(seen)["connections"]
    assert connections == {"frontend.sock": 0, "local.sock": 0, "control.sock": 0,
                           "buffers.sock": 0}, impostor_err


def _listening_socket(path: Path, mode: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, mode)
    return sock


def test_the_runtime_dir_checker_refuses_what_the_daemon_does_not_make(tmp_path, outsider):
    uid = pwd.getpwnam(outsider[0]).pw_uid
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o700)
    frontend = _listening_socket(run / "frontend.sock", 0o600)
    try:
        trustdir.check_socket_in(run, run / "frontend.sock")  # as the daemon makes it
        trustdir.check_socket_in(run, run / "private" / "admin.sock")  # absent: nothing to judge
        (tmp_path / "link").symlink_to(run)
        with pytest.raises(trustdir.UntrustedRuntimeDir, match="link: it is owned by .* is a symbolic link"):
            trustdir.check_runtime_dir(tmp_path / "link")
        os.chmod(run / "frontend.sock", 0o666)
        with pytest.raises(trustdir.UntrustedRuntimeDir, match="frontend.sock: .* has mode 0666"):
            trustdir.check_socket_in(run, run / "frontend.sock")
        os.chmod(run / "frontend.sock", 0o600)
        os.chown(run / "frontend.sock", uid, -1)
        with pytest.raises(trustdir.UntrustedRuntimeDir,
                           match=f"frontend.sock: it is owned by {outsider[0]} .* not by root"):
            trustdir.check_socket_in(run, run / "frontend.sock")
        os.chmod(run, 0o755)
        with pytest.raises(trustdir.UntrustedRuntimeDir, match="run: .* has mode 0755, not 0700 or 0750"):
            trustdir.check_runtime_dir(run)
    finally:
        frontend.close()
    with pytest.raises(NoDaemon, match="does not exist"):
        trustdir.check_runtime_dir(tmp_path / "absent")


def test_a_client_with_no_configuration_takes_the_local_socket_only_as_the_daemon_makes_it(
        tmp_path, outsider):
    """rawconfig.discovered_frontend: ``local.sock`` where the daemon made one, else
    ``frontend.sock``; a local.sock someone else made is refused, never passed over."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o700)
    frontend = _listening_socket(run / "frontend.sock", 0o600)
    try:
        assert rawconfig.discovered_frontend(run) == f"ipc://{run}/frontend.sock"
        local = _listening_socket(run / "local.sock", 0o600)
        try:
            assert rawconfig.discovered_frontend(run) == f"unix://{run}/local.sock"
            os.chown(run / "local.sock", pwd.getpwnam(outsider[0]).pw_uid, -1)
            with pytest.raises(trustdir.UntrustedRuntimeDir,
                               match=f"local.sock: it is owned by {outsider[0]}"):
                rawconfig.discovered_frontend(run)
        finally:
            local.close()
    finally:
        frontend.close()


def test_a_foreign_dir_is_trusted_only_where_root_alone_could_make_it(tmp_path, outsider):
    uid = pwd.getpwnam(outsider[0]).pw_uid
    shared_tmp, root_only = tmp_path / "tmp", tmp_path / "run"
    for parent, mode in ((shared_tmp, 0o1777), (root_only, 0o755)):
        parent.mkdir()
        os.chmod(parent, mode)
        (parent / "modelwarden").mkdir()
        os.chmod(parent / "modelwarden", 0o750)
        os.chown(parent / "modelwarden", uid, -1)
    with pytest.raises(trustdir.UntrustedRuntimeDir, match=f"owned by {outsider[0]} .* not by root"):
        trustdir.check_runtime_dir(shared_tmp / "modelwarden")  # anyone could have made it
    trustdir.check_runtime_dir(root_only / "modelwarden")  # systemd's RuntimeDirectory= for a user


def test_a_hello_naming_a_buffer_socket_in_a_squatted_dir_is_refused(tmp_path, outsider, monkeypatch):
    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    os.chmod(shared_tmp, 0o1777)
    squat = shared_tmp / "modelwarden-0"
    squat.mkdir()
    os.chmod(squat, 0o700)
    os.chown(squat, pwd.getpwnam(outsider[0]).pw_uid, -1)
    monkeypatch.setattr(rawconfig, "default_runtime_dir", lambda: squat)
    session = Session(f"ipc://{tmp_path}/frontend.sock", None, False)
    offer = {"shm": {"enabled": True, "threshold": 1, "channel": str(squat / "buffers.sock")}}
    with pytest.raises(trustdir.UntrustedRuntimeDir, match=f"refusing {squat}: it is owned by {outsider[0]}"):
        session.accept_offer(offer)
    assert session.offer is None and session.arena is None
    offer["shm"]["channel"] = str(tmp_path / "buffers.sock")  # where a configured daemon put it
    session.accept_offer(offer)
    assert session.arena is not None
    session.close()


# -- the pid file: only the daemon's user may open it, so only it may lock it ----------------------


CLI = ("import site, sys; site.addsitedir(sys.argv[1]); "
       "from modelwarden.cli import main; sys.exit(main(sys.argv[2:]))")
HOLD_THE_LOCK = ("import fcntl, sys; f = open(sys.argv[1]); print('opened', flush=True); "
                 "fcntl.flock(f, fcntl.LOCK_SH); print('locked', flush=True); sys.stdin.read()")


def test_a_group_member_cannot_lock_the_pid_file_to_block_a_restart(outsider):
    user, group = outsider
    with Daemon([], daemon={"shm_group": group}) as daemon:
        os.chmod(daemon.dir, 0o755)  # mkdtemp made it 0700: let the member reach run/
        poll_until(lambda: daemon.status(), 30, message="the daemon answering")
        pid_file = daemon.dir / "run" / "modelwarden.pid"
        assert stat.S_IMODE(os.stat(pid_file).st_mode) == 0o600
        holder = subprocess.Popen(["setpriv", "--reuid", user, "--regid", group, "--init-groups",
                                   _python_for_others(), "-I", "-S", "-c", HOLD_THE_LOCK, str(pid_file)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd="/")
        try:
            said = holder.stdout.readline()  # 'opened' (then it waits for the lock), or nothing
            assert daemon.stop() == 0
            assert said == "", "a member opened the pid file"
            assert "PermissionError" in holder.communicate(timeout=30)[1]
            # The member still tells a stale socket at once: by the lock alone, as it cannot read the pid.
            stale = run_as(user, group, [_python_for_others(), "-I", "-S", "-c", CLI,
                                         sysconfig.get_paths()["purelib"], "status", "--control",
                                         daemon.control, "--timeout", "20"], timeout=60)
            assert stale.returncode == 3 and "no daemon runs for" in stale.stderr, stale.stderr
            assert "nobody holds its pid file's lock" in stale.stderr
            daemon.start()  # the operator's restart, on the same directory
            assert poll_until(lambda: daemon.status(), 30, message="the restarted daemon")
            assert daemon.process.poll() is None
        finally:
            holder.kill()
            holder.communicate()


def test_an_existing_pid_file_is_set_to_0600_and_a_foreign_one_refused(tmp_path, outsider):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chmod(run, 0o700)
    (run / "modelwarden.pid").write_text("12345\n")
    os.chmod(run / "modelwarden.pid", 0o644)  # as an earlier version made it
    with runtime.claim_runtime_dir(run, None):
        assert stat.S_IMODE(os.stat(run / "modelwarden.pid").st_mode) == 0o600
        assert (run / "modelwarden.pid").read_text() == f"{os.getpid()}\n"
    os.chown(run / "modelwarden.pid", pwd.getpwnam(outsider[0]).pw_uid, -1)
    with pytest.raises(DaemonError, match=f"modelwarden.pid: is owned by {outsider[0]}"):
        runtime.claim_runtime_dir(run, None)


# -- workers' sys.path: python_path and the interpreter's own, never the daemon's cwd ---------------


PLANTED = """import pathlib
pathlib.Path({marker!r}).write_text("the planted module ran")
raise SystemExit("planted")
"""


class DaemonStartedIn(Daemon):
    """The real daemon, started as ``python -m modelwarden`` from ``cwd``: sys.path[0] is cwd."""

    def __init__(self, cwd: Path, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cwd = cwd

    def start(self) -> "DaemonStartedIn":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "modelwarden", "serve", "--config", str(self.config_path)],
            cwd=self.cwd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        return self


@pytest.mark.parametrize("found_on", ["python_path", "PYTHONPATH"])
def test_a_module_planted_in_the_daemons_cwd_never_runs_in_a_worker(tmp_path, found_on):
    """The real module on ``python_path``, or on the interpreter's own path (PYTHONPATH), and
    one of the same name in the directory the daemon was started from."""
    import torch

    from modelwarden.examples import make_mlp
    from modelwarden.supervisor.fleet.versions import VersionBook

    models, planted, marker = tmp_path / "models", tmp_path / "cwd", tmp_path / "planted-ran"
    models.mkdir()
    planted.mkdir()
    (models / "trustmlp.py").write_text("from modelwarden.examples import make_mlp\n")
    (planted / "trustmlp.py").write_text(PLANTED.format(marker=str(marker)))
    model = mlp_model("trustmlp", workers=1, source="python:trustmlp:make_mlp")
    if found_on == "python_path":
        settings, env = {"python_path": [str(models)]}, {}
    else:
        settings, env = {"python_path": []}, {"PYTHONPATH": str(models)}
    with DaemonStartedIn(planted, [model], daemon=settings, env=env) as daemon:
        daemon.wait_ready()
        x = torch.randn(3, 64)
        with Client(daemon.endpoint) as client:
            torch.testing.assert_close(client.infer("trustmlp", x), make_mlp(hidden=32).eval()(x))
        config = load_settings(daemon.config_path).models[0]
        version = daemon.status()["models"][0]["version"]
        assert version == VersionBook(daemon.dir, [str(models)]).of(config)  # the real file's
        assert version != VersionBook(daemon.dir, [str(planted)]).of(config)
    assert not marker.exists()


class DaemonByScript(DaemonStartedIn):
    """Started by the console script (``modelwarden serve``, as the unit does): the supervisor's
    sys.path[0] is the script's directory, but a spawned child starts as ``python -c``."""

    def start(self) -> "DaemonByScript":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("modelwarden")), "serve", "--config",
             str(self.config_path)], cwd=self.cwd, env=self.env, stdout=self._log,
            stderr=subprocess.STDOUT)
        return self


def test_a_stdlib_name_planted_in_the_cwd_never_runs_in_a_spawned_worker(tmp_path):
    """``multiprocessing`` is what spawn's bootstrap imports before it sets sys.path."""
    if not Path(sys.executable).with_name("modelwarden").exists():
        pytest.skip("no modelwarden console script beside this python")
    planted, marker = tmp_path / "cwd", tmp_path / "planted-ran"
    (planted / "multiprocessing").mkdir(parents=True)
    (planted / "multiprocessing" / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    with DaemonByScript(planted, [mlp_model(workers=1)]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            assert client.infer("mlp", np.ones((1, 64), np.float32)).shape == (1, 10)
    assert not marker.exists()
