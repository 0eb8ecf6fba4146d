"""A model that cannot load: its worker exits with the documented code, status shows why, the
slot backs off and ends FATAL, and the other model serves throughout."""

import subprocess
import sys

import torch

from modelwarden.client.client import Client, NoWorker
from modelwarden.shared.states import EXIT_LOAD_ERROR, EXIT_NAMES
from tests.faulty import reference
from tests.helpers import ROOT, Daemon, faulty_model, poll_until


def test_load_failure_backs_off_then_fatal_while_others_serve():
    broken = faulty_model("broken", "load_error", backoff_initial=0.1, backoff_max=0.2,
                          max_start_failures=3)
    healthy = faulty_model("healthy")
    with Daemon([broken, healthy]) as daemon:
        daemon.wait_ready(models=["healthy"])

        def fatal():
            worker = daemon.workers("broken")[0]
            return worker if worker["state"] == "FATAL" else None

        worker = poll_until(fatal, 90, message="broken slot FATAL")
        assert worker["last_exit"] == EXIT_NAMES[EXIT_LOAD_ERROR]
        assert "refuses to load" in worker["error"]
        assert worker["restarts"] == 3
        status = daemon.status()
        assert status["models"][0]["fatal_slots"] == ["broken#0"]
        result = subprocess.run([sys.executable, "-m", "modelwarden", "status", "--control",
                                 daemon.control], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 1  # degraded
        assert "refuses to load" in result.stdout
        x = torch.randn(3, 8)
        with Client(daemon.endpoint) as client:
            torch.testing.assert_close(client.infer("healthy", x), reference(x))
            try:
                client.infer("broken", x)
                raise AssertionError("a FATAL model must answer NO_WORKER")
            except NoWorker:
                pass


def test_warm_up_uses_the_probe_input_when_no_inputs_are_declared(tmp_path):
    import numpy as np

    from modelwarden.shared.states import EXIT_WARMUP_ERROR
    from tests.faulty import MARKER

    np.save(tmp_path / "probe.npy", np.full((1, 8), MARKER, dtype=np.float32))
    model = faulty_model("warms", "raise", backoff_initial=0.05, max_start_failures=1,
                         probe={"input": str(tmp_path / "probe.npy")})
    del model["inputs"]
    with Daemon([model]) as daemon:
        worker = poll_until(lambda: next((w for w in daemon.workers() if w["state"] == "FATAL"), None),
                            60, message="the warm-up failure")
        assert worker["last_exit"] == EXIT_NAMES[EXIT_WARMUP_ERROR]
        assert "marker" in worker["error"]


def test_stopping_answers_requests_no_worker_could_serve():
    from modelwarden.client.client import ShuttingDown

    broken = faulty_model("later", "load_error", backoff_initial=60.0, max_start_failures=10)
    with Daemon([broken]) as daemon:
        poll_until(lambda: daemon.workers()[0]["state"] == "BACKOFF", 60, message="BACKOFF")
        with Client(daemon.endpoint, timeout=120) as client:
            future = client.submit("later", torch.randn(2, 8))  # waits: the slot may come back
            poll_until(lambda: daemon.status()["models"][0]["queued"] == 1, 10, message="queued")
            daemon.process.terminate()
            try:
                future.result(timeout=60)
                raise AssertionError("nothing could serve it")
            except ShuttingDown:
                pass
        assert daemon.process.wait(30) == 0
