"""modelwarden/testing.py, the harness that tools (bench/) and users' own tests start daemons
with: its TOML writer, its polls, and one daemon started from a file as a user would."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib

import pytest

from modelwarden.testing import DaemonGone, LocalDaemon, PollTimeout, poll_until, render_toml
from tests.helpers import ROOT


def test_the_harness_imports_no_torch_numpy_zmq_or_pydantic():
    code = ("import sys, modelwarden.testing\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'zmq', 'pydantic'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_render_toml_writes_what_tomllib_reads_back():
    document = {
        "version": 2, "models_dir": "/srv",
        "daemon": {"runtime_dir": "/tmp/x", "frontend": ["ipc://a", "tcp://127.0.0.1:5555"],
                   "heartbeat_interval": 0.2, "allow_oversubscription": True, "labels": {"a": 1}},
        "gateway": {"http": "127.0.0.1:8000"},
        "models": [{"name": "m", "workers": 2, "kwargs": {"fault": "none", "scale": 0.5},
                    "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 8]}],
                    "probe": {"interval": 0.2, "golden": "/g.npy"}},
                   {"name": "n", "source": 'python:a "quoted" \\ name'}],
        "empty": [],
    }
    assert tomllib.loads(render_toml(document)) == document


def test_poll_until_returns_the_value_or_names_the_last_error():
    calls = []
    assert poll_until(lambda: calls.append(1) or (len(calls) >= 3 and "done"), 5, 0.001) == "done"

    def broken():
        raise OSError("no socket yet")

    with pytest.raises(PollTimeout, match="no socket yet"):
        poll_until(broken, timeout=0.05, interval=0.01, message="a socket")


def test_a_daemon_that_exits_fails_the_wait_at_once_with_its_log(tmp_path):
    config = tmp_path / "broken.toml"
    config.write_text('[daemon]\nno_such_key = 1\n')
    with LocalDaemon(config) as daemon:
        started = time.monotonic()
        with pytest.raises(DaemonGone, match="no_such_key"):
            daemon.wait_ready(timeout=60)
        assert time.monotonic() - started < 30  # not the wait's whole timeout


def test_a_daemon_from_a_users_file_serves_in_a_private_directory_and_is_gone_after(tmp_path):
    import torch

    from modelwarden import Client
    from modelwarden.examples import make_mlp

    config = tmp_path / "modelwarden.toml"
    config.write_text(render_toml({
        "daemon": {"allow_oversubscription": True},
        "models": [{"name": "mlp", "source": "python:modelwarden.examples:make_mlp", "kwargs": {"hidden": 8},
                    "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 1,
                    "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 64]}]}]}))
    daemon = LocalDaemon(config).start()
    try:
        status = daemon.wait_ready()
        assert [m["name"] for m in status["models"]] == ["mlp"]
        assert daemon.endpoint == f"ipc://{daemon.dir}/run/frontend.sock"
        x = torch.randn(3, 64)
        with Client(daemon.endpoint, timeout=10) as client:
            assert torch.allclose(client.infer("mlp", x), make_mlp(hidden=8)(x), atol=1e-5)
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
    assert not daemon.dir.exists()
