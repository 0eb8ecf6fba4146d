"""Every error code a client can see, provoked end to end where no other test does: the model's
own exception (MODEL_ERROR) and running out of memory (OUT_OF_MEMORY) both leave the worker up.

Where the rest are proven: BAD_REQUEST, BAD_INPUT, UNKNOWN_MODEL (test_serving), NO_WORKER
(test_load_failure), WORKER_DIED, SHUTTING_DOWN (test_lifecycle), POISON (test_chaos), TIMEOUT,
OVERLOADED (test_reliability). INTERNAL is a bug in modelwarden by definition: no client input
reaches it, and product code holds no switch to force it (the handlers that answer it are the
last resort of arbiter._on_frontend and _control_message).
"""

import pytest
import torch

from modelwarden.shared.client import Client, ModelError, OutOfMemory
from tests.faulty import MARKER, reference
from tests.helpers import Daemon, faulty_model


@pytest.fixture(scope="module")
def daemon():
    with Daemon([faulty_model("raises", "raise"), faulty_model("ooms", "oom")]) as running:
        running.wait_ready()
        yield running


@pytest.mark.parametrize("model, error, words", [
    ("raises", ModelError, "ValueError: the input holds the marker value"),
    ("ooms", OutOfMemory, "OutOfMemoryError"),
])
def test_a_model_failure_is_typed_and_the_worker_stays_up(daemon, model, error, words):
    (pid,) = [worker["pid"] for worker in daemon.workers(model)]
    with Client(daemon.endpoint, timeout=30) as client:
        with pytest.raises(error) as info:
            client.infer(model, torch.full((2, 8), MARKER))
        assert words in info.value.message and info.value.worker == f"{model}#0"
        x = torch.randn(3, 8)
        torch.testing.assert_close(client.infer(model, x), reference(x))
    assert [worker["pid"] for worker in daemon.workers(model)] == [pid]
    assert daemon.workers(model)[0]["errors"] == 1
