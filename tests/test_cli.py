"""The ``modelwarden`` command as an operator meets it: what it imports, how it says no, how fast
it finds that no daemon runs, the signals it gives no meaning to, ``status --watch``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from modelwarden.supervisor.devices import visible_gpus
from tests.helpers import ROOT, Daemon, poll_until, render_config

EXIT_CONFIG, EXIT_UNREACHABLE = 2, 3


def cli(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {})}
    environment.pop("MODELWARDEN_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "modelwarden", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=environment, timeout=timeout)


def imports_after(argv: list[str]) -> dict:
    """Run the CLI in a fresh interpreter; which heavy modules it loaded, and its exit code."""
    script = ("import json, sys\n"
              "from modelwarden.supervisor.cli import main\n"
              f"code = main({argv!r})\n"
              "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules,"
              " 'numpy': 'numpy' in sys.modules}))\n")
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
            watch = subprocess.Popen([sys.executable, "-m", "modelwarden", "status", "--watch", "0.2",
                                      "--control", daemon.control], stdout=sink,
                                     stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                poll_until(lambda: out.read_text().count("(Ctrl-C ends)") >= 3, 30,
                           message="three status frames")
            finally:
                watch.send_signal(signal.SIGINT)
                code = watch.wait(30)
        assert code == 0, out.read_text()
        assert "Traceback" not in out.read_text()
