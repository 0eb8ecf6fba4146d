"""The ``modelwarden`` command as an operator meets it: what it imports, how it says no, how fast
it finds that no daemon runs, the signals it gives no meaning to, ``status --watch``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from modelwarden.supervisor.fleet.devices import visible_gpus
from tests.helpers import ROOT, Daemon, poll_until, render_config, temporary_user

EXIT_CONFIG, EXIT_UNREACHABLE = 2, 3


def cli(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {})}
    environment.pop("MODELWARDEN_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "modelwarden", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=environment, timeout=timeout)


def imports_after(argv: list[str]) -> dict:
    """Run the CLI in a fresh interpreter; which heavy modules it loaded, and its exit code."""
    script = ("import json, sys\n"
              "from modelwarden.cli import main\n"
              f"code = main({argv!r})\n"
              "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules,"
              " 'numpy': 'numpy' in sys.modules, 'pydantic': 'pydantic' in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_status_restart_and_stop_never_import_torch():
    with Daemon([]) as daemon:
        poll_until(lambda: daemon.status(), 30, message="the daemon answering")
        found = {command: imports_after([command, "--control", daemon.control, "--admin", daemon.admin])
                 for command in ("status", "restart", "stop")}
        assert {command: (f["code"], f["torch"]) for command, f in found.items()} == {
            "status": (0, False), "restart": (0, False), "stop": (0, False)}, found
        poll_until(lambda: daemon.process.poll() == 0, 30, message="stopped by the CLI")


def test_control_commands_find_the_daemon_through_the_config_without_validating_it():
    """`watch modelwarden status` must stay cheap: the endpoint comes from the raw file
    (shared/rawconfig.py), so neither pydantic nor torch is imported, and the answer is the
    daemon's even with MODELWARDEN_DAEMON__CONTROL pointing the file elsewhere."""
    with Daemon([]) as daemon:
        poll_until(lambda: daemon.status(), 30, message="the daemon answering")
        found = imports_after(["status", "--config", str(daemon.config_path)])
        assert found == {"code": 0, "torch": False, "numpy": False, "pydantic": False}, found
        # status asks the admin socket when it may (root here), else the control socket.
        moved = cli("status", "--config", str(daemon.config_path),
                    env={"MODELWARDEN_DAEMON__CONTROL": "ipc:///nonexistent/control.sock"})
        assert moved.returncode == 0, moved.stderr
        moved = cli("status", "--config", str(daemon.config_path),
                    env={"MODELWARDEN_DAEMON__CONTROL": "ipc:///nonexistent/control.sock",
                         "MODELWARDEN_DAEMON__ADMIN": "ipc:///nonexistent/admin.sock"})
        assert moved.returncode == 3 and "/nonexistent/control.sock" in moved.stderr, moved.stderr
        assert cli("stop", "--config", str(daemon.config_path)).returncode == 0
        poll_until(lambda: daemon.process.poll() == 0, 30, message="stopped through the admin socket")


def one_line_error(done: subprocess.CompletedProcess, code: int = EXIT_CONFIG) -> str:
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelwarden: "), done.stderr
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    np.save(tmp_path / "good.npy", np.ones((2, 4), np.float32))
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY garbage, not an array")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 not a zip either")
    (tmp_path / "cuda.toml").write_text(render_config(
        {"runtime_dir": str(tmp_path / "run")},
        [{"name": "gpu", "source": "python:tests.faulty:make_echo", "device": "cuda:0", "warmup": 0}]))
    return tmp_path


NO_DAEMON = "ipc:///nonexistent/modelwarden/frontend.sock"


@pytest.mark.parametrize("argv, says", [
    (["infer", "m", "-i", "{d}/missing.npy", "--endpoint", NO_DAEMON], "missing.npy: no such file"),
    (["infer", "m", "-i", "{d}/corrupt.npy", "--endpoint", NO_DAEMON], "not a readable .npy/.npz"),
    (["infer", "m", "-i", "{d}/corrupt.npz", "--endpoint", NO_DAEMON], "not a readable .npy/.npz"),
    (["infer", "m", "-i", "{d}", "--endpoint", NO_DAEMON], "a directory"),
    (["infer", "m", "-i", "{d}/good.npy", "-o", "{d}/y.txt", "--endpoint", NO_DAEMON],
     "name a .npy file"),
    (["infer", "m", "-i", "{d}/good.npy", "-o", "{d}/no/such/dir/y.npy", "--endpoint", NO_DAEMON],
     "no such directory"),
    (["serve"], "serve needs a configuration"),
    (["status", "--watch", "0", "--control", NO_DAEMON], "--watch SECONDS must be more than 0"),
])
def test_a_user_mistake_gets_one_line_and_exit_2(files, argv, says):
    line = one_line_error(cli(*[arg.format(d=files) for arg in argv]))
    assert says in line, line
    assert not (files / "y.txt").exists() and not (files / "y.txt.npy").exists()


@pytest.mark.skipif(visible_gpus() > 0, reason="this machine has a CUDA device")
def test_check_refuses_a_cuda_device_this_machine_lacks(files):
    line = one_line_error(cli("serve", "--check", "--config", str(files / "cuda.toml")))
    assert "no such device here: cuda:0" in line, line


def test_a_stale_socket_is_named_at_once_for_every_command(tmp_path):
    with Daemon([]) as daemon:
        pid = poll_until(lambda: daemon.status()["daemon"]["pid"], 30, message="the daemon answering")
        assert daemon.stop() == 0
        assert Path(daemon.control[len("ipc://"):]).exists()  # what a clean stop leaves behind
        started = time.monotonic()
        status = cli("status", "--control", daemon.control, "--timeout", "20")
        infer = cli("infer", "m", "-i", str(_npy(tmp_path)), "--endpoint", daemon.endpoint,
                    "--timeout", "20")
        elapsed = time.monotonic() - started
        for done in (status, infer):
            line = one_line_error(done, EXIT_UNREACHABLE)
            assert f"no daemon runs for {daemon.dir}/run (stale socket from pid {pid})" in line, line
        assert elapsed < 15, f"took {elapsed:.1f}s: the sockets were waited on, not recognised"


def _npy(directory: Path) -> Path:
    np.save(directory / "x.npy", np.ones((1, 4), np.float32))
    return directory / "x.npy"


def test_sigusr1_and_sigusr2_are_logged_and_ignored():
    with Daemon([]) as daemon:
        poll_until(lambda: daemon.status(), 30, message="the daemon answering")
        for signum in (signal.SIGUSR1, signal.SIGUSR2):
            daemon.process.send_signal(signum)
            poll_until(lambda: f"{signum.name} ignored" in daemon.log(), 10,
                       message=f"the {signum.name} line")
        assert daemon.status()["daemon"]["pid"] == daemon.process.pid
        assert daemon.stop() == 0


def test_status_watch_repeats_until_interrupted(tmp_path):
    with Daemon([]) as daemon:
        poll_until(lambda: daemon.status(), 30, message="the daemon answering")
        out = tmp_path / "watch.out"
        with open(out, "w") as sink:
            # As from a terminal: a runner started in the background (``cmd &`` without job
            # control) passes SIGINT down ignored, and Python then never turns it into Ctrl-C.
            watch = subprocess.Popen([sys.executable, "-m", "modelwarden", "status", "--watch", "0.2",
                                      "--control", daemon.control], stdout=sink,
                                     stderr=subprocess.STDOUT, cwd=ROOT,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            try:
                poll_until(lambda: out.read_text().count("(Ctrl-C ends)") >= 3, 30,
                           message="three status frames")
            finally:
                watch.send_signal(signal.SIGINT)
                code = watch.wait(30)
        assert code == 0, out.read_text()
        assert "Traceback" not in out.read_text()


# -- as other users: the system daemon in /run/modelwarden ----------------------------------------


def _python_for_others() -> str:
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (sys.executable, shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and _reachable_by_all(Path(os.path.realpath(candidate))):
            return candidate
    pytest.skip("no python interpreter other users may execute")


def _reachable_by_all(path: Path) -> bool:
    return all(os.stat(part).st_mode & stat.S_IXOTH for part in path.parents)


def cli_as(user: str, group: str, *argv: str) -> subprocess.CompletedProcess:
    """The CLI as ``user``, with no MODELWARDEN_* variable and no XDG_RUNTIME_DIR."""
    script = ("import site, sys; site.addsitedir(sys.argv[1]); "
              "from modelwarden.cli import main; sys.exit(main(sys.argv[2:]))")
    return subprocess.run(["setpriv", "--reuid", user, "--regid", group, "--init-groups",
                           _python_for_others(), "-I", "-S", "-c", script,
                           sysconfig.get_paths()["purelib"], *argv],
                          capture_output=True, text=True, cwd="/", timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"})


@pytest.fixture(scope="module")
def member_and_outsider():
    if os.geteuid() != 0:
        pytest.skip("creates users and groups and uses /run/modelwarden: needs root")
    if shutil.which("setpriv") is None or shutil.which("useradd") is None:
        pytest.skip("needs setpriv and useradd")
    if not _reachable_by_all(Path(sysconfig.get_paths()["purelib"]) / "x"):
        pytest.skip("the test environment is not readable by other users")
    with temporary_user("mwm") as member, temporary_user("mwo") as outsider:
        yield member, outsider


def test_the_system_daemon_is_found_by_its_group_and_refuses_others_by_name(member_and_outsider, tmp_path):
    (member, group), (outsider, outsider_group) = member_and_outsider
    system = Path("/run/modelwarden")
    if system.exists():
        pytest.skip("/run/modelwarden exists: a daemon of this machine may be using it")
    try:
        with Daemon([], daemon={"runtime_dir": str(system), "shm_group": group}) as daemon:
            daemon.control = f"ipc://{system}/control.sock"
            daemon.admin = f"ipc://{system}/private/admin.sock"
            poll_until(lambda: daemon.status(), 30, message="the system daemon answering")
            found = cli_as(member, group, "status", "--json")
            assert found.returncode == 0, found.stderr
            assert json.loads(found.stdout)["daemon"]["pid"] == daemon.process.pid
            refused = cli_as(outsider, outsider_group, "status")
            line = one_line_error(refused, EXIT_UNREACHABLE)
            assert line.startswith(f"modelwarden: permission denied: {system}/control.sock"), line
            assert f"a member of group {group}" in line, line

            # Writing outputs where this user may not: said before anything is sent.
            shared = Path(tempfile.mkdtemp(prefix="mw-out-", dir="/tmp"))
            try:
                os.chmod(shared, 0o755)
                np.save(shared / "x.npy", np.ones((1, 4), np.float32))
                os.chmod(shared / "x.npy", 0o644)
                done = cli_as(member, group, "infer", "m", "-i", str(shared / "x.npy"),
                              "-o", str(shared / "y.npy"))
                assert "not writable here" in one_line_error(done)
            finally:
                shutil.rmtree(shared)
            assert daemon.stop() == 0
    finally:
        shutil.rmtree(system, ignore_errors=True)
