"""Every error code a client can see, provoked end to end where no other test does: the model's
own exception (MODEL_ERROR) leaves the worker up; running out of memory (OUT_OF_MEMORY, a
ModelError too) gets that worker replaced, replace before retire.

Where the rest are proven: BAD_REQUEST, BAD_INPUT, UNKNOWN_MODEL (test_serving), NO_WORKER
(test_load_failure), WORKER_DIED, SHUTTING_DOWN (test_lifecycle), POISON (test_chaos), TIMEOUT,
OVERLOADED (test_reliability). INTERNAL is a bug in modelwarden by definition: no client input
reaches it, and product code holds no switch to force it (the handlers that answer it are the
last resort of arbiter._on_frontend and _control_message).
"""

import pytest
import torch

from modelwarden.client.client import Client, ModelError, OutOfMemory
from tests.faulty import MARKER, reference
from tests.helpers import Daemon, faulty_model, poll_until


@pytest.fixture(scope="module")
def daemon():
    with Daemon([faulty_model("raises", "raise"), faulty_model("ooms", "oom")]) as running:
        running.wait_ready()
        yield running


def test_a_model_exception_is_typed_and_the_worker_stays_up(daemon):
    (pid,) = [worker["pid"] for worker in daemon.workers("raises")]
    with Client(daemon.endpoint, timeout=30) as client:
        with pytest.raises(ModelError) as info:
            client.infer("raises", torch.full((2, 8), MARKER))
        assert "ValueError: the input holds the marker value" in info.value.message
        assert info.value.worker == "raises#0" and not isinstance(info.value, OutOfMemory)
        x = torch.randn(3, 8)
        torch.testing.assert_close(client.infer("raises", x), reference(x))
    assert [worker["pid"] for worker in daemon.workers("raises")] == [pid]
    assert daemon.workers("raises")[0]["errors"] == 1


def test_out_of_memory_is_typed_and_that_worker_is_replaced(daemon):
    (pid,) = [worker["pid"] for worker in daemon.workers("ooms")]
    with Client(daemon.endpoint, timeout=30) as client:
        with pytest.raises(OutOfMemory) as info:
            client.infer("ooms", torch.full((2, 8), MARKER))
        assert "OutOfMemoryError" in info.value.message and info.value.worker == "ooms#0"
        assert isinstance(info.value, ModelError)  # `except ModelError` catches it as well
        x = torch.randn(3, 8)
        torch.testing.assert_close(client.infer("ooms", x), reference(x))  # nothing waits on it
        poll_until(lambda: [(w["pid"] != pid, w["state"]) for w in daemon.workers("ooms")]
                   == [(True, "READY")], 60, message="a fresh process in the slot")
        torch.testing.assert_close(client.infer("ooms", x), reference(x))
    (worker,) = daemon.workers("ooms")
    assert [cause["cause"] for cause in worker["restart_causes"]] == ["replaced: out of memory in forward"]
