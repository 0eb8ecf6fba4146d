"""Prepared models (``[models.prepare]``, worker/prepare.py) and the outputs a worker learns
from its warm-up (worker/outputs.py), end to end: the real daemon, real workers.

A reduced precision, a frozen TorchScript and a torch.compile'd model are each held to the FP32
answers of the model as loaded before READY; one whose answers differ past its tolerance never
goes READY and says by how much. Unit tests of the hold and of learned outputs come first."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from modelwarden.client.client import Client
from modelwarden.shared.config import PrepareConfig
from modelwarden.shared.states import EXIT_NAMES, EXIT_PREPARE_ERROR
from modelwarden.worker.outputs import learned_outputs
from modelwarden.worker.prepare import PrepareError, hold_to_reference, prepare
from tests.helpers import Daemon, mlp_model, poll_until
from tests.prepared import make_cancelling, make_scripted, make_tiny

from examples.models import make_mlp

REFERENCE = make_mlp(hidden=32).requires_grad_(False)
TINY = make_tiny().requires_grad_(False)
SPEC8 = [{"name": "x", "dtype": "float32", "shape": [-1, 8]}]


# -- in-process: the hold and the outputs ------------------------------------------------------


def test_hold_compares_nested_outputs_and_measures_the_largest_difference():
    reference = (torch.zeros(2, 3), {"b": torch.ones(4)})
    close = (torch.full((2, 3), 0.004), {"b": torch.ones(4) * 1.01})
    assert hold_to_reference(reference, close, atol=1e-2, rtol=1e-2) == (True, pytest.approx(0.01))
    ok, worst = hold_to_reference(reference, (torch.full((2, 3), 0.5), {"b": torch.ones(4)}), 1e-2, 1e-2)
    assert not ok and worst == pytest.approx(0.5)
    # a golden file's list of arrays holds a tuple output; a shape or count change, or NaN, misses
    assert hold_to_reference([np.zeros((2, 3)), np.ones(4)], reference, 0, 0) == (True, 0.0)
    assert hold_to_reference(reference, (torch.zeros(3, 2), {"b": torch.ones(4)}), 1, 1) == (False, math.inf)
    assert hold_to_reference(reference, (torch.zeros(2, 3),), 1, 1) == (False, math.inf)
    assert hold_to_reference(torch.zeros(2), torch.tensor([0.0, float("nan")]), 1, 1) == (False, math.inf)


def test_reduced_precision_casts_inputs_and_gives_float32_back():
    model = make_tiny().eval()
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        prepared = prepare(model, PrepareConfig(dtype="bfloat16"), torch.device("cpu"))
        answer = prepared(x)
    assert next(model.parameters()).dtype == torch.bfloat16 and answer.dtype == torch.float32
    ok, worst = hold_to_reference(expected, answer, 1e-2, 1e-2)
    assert ok and 0 < worst < 1e-2


def test_freeze_refuses_what_is_not_torchscript_and_names_the_step():
    with pytest.raises(PrepareError, match=r"^freeze: the source gave a Sequential, not a TorchScript"):
        prepare(make_tiny().eval(), PrepareConfig(freeze=True), torch.device("cpu"))
    with pytest.raises(PrepareError, match=r"^dtype=float16: the source gave a function"):
        prepare(lambda x: x, PrepareConfig(dtype="float16"), torch.device("cpu"))


def test_learned_outputs_name_dtype_and_shape_with_the_varying_dims():
    assert learned_outputs(torch.zeros(4, 10), 0) == [
        {"name": "output__0", "dtype": "float32", "shape": [-1, 10]}]
    assert learned_outputs((torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 7, 3)), None,
                           varying=(1,)) == [
        {"name": "output__0", "dtype": "int64", "shape": [4, -1]},
        {"name": "output__1", "dtype": "float32", "shape": [4, -1, 3]}]
    assert learned_outputs({"logits": torch.zeros(2, 2, dtype=torch.bfloat16),
                            "labels": [["a", "b"], ["c", "d"]], "score": 0.5}, 0) == [
        {"name": "logits", "dtype": "bfloat16", "shape": [-1, 2]},
        {"name": "labels", "dtype": "str", "shape": [-1, 2]},
        {"name": "score", "dtype": "float32", "shape": []}]
    assert learned_outputs([b"x", b"yz"], 0) == [{"name": "output__0", "dtype": "bytes", "shape": [-1]}]


# -- the real daemon -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prepared")
    make_scripted().save(str(directory / "tiny.ts"))
    one = {"workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 2}
    models = [
        mlp_model("bf16", workers=1, prepare={"dtype": "bfloat16"},
                  probe={"interval": 0.2, "latency_slack_ms": 5000}),
        {"name": "cancel", "source": "python:tests.prepared:make_cancelling", **one,
         "inputs": SPEC8, "prepare": {"dtype": "bfloat16"}, "max_start_failures": 1},
        {"name": "compiled", "source": "python:tests.prepared:make_tiny", **one, "inputs": SPEC8,
         "prepare": {"compile": "default", "atol": 1e-5, "rtol": 1e-5}},
        {"name": "frozen", "source": f"torchscript:{directory / 'tiny.ts'}", **one, "inputs": SPEC8,
         "prepare": {"freeze": True, "atol": 1e-5, "rtol": 1e-5}},
        {"name": "unfreezable", "source": "python:tests.prepared:make_tiny", **one,
         "inputs": SPEC8, "prepare": {"freeze": True}, "max_start_failures": 1},
        {"name": "plain", "source": "python:tests.prepared:make_tiny", **one, "inputs": SPEC8},
    ]
    with Daemon(models) as running:
        running.wait_ready(timeout=300, models=["bf16", "compiled", "frozen", "plain"])
        yield running


def failure_of(daemon, model: str) -> dict:
    """The worker row of a model that failed to start, once its failure is reported."""
    return poll_until(lambda: next((row for row in daemon.workers(model) if row["error"]), None),
                      60, message=f"{model}'s failure in status")


def test_a_bfloat16_model_within_tolerance_serves_answers_close_to_fp32(daemon):
    row = daemon.workers("bf16", "READY")[0]
    assert row["prepare"]["steps"] == ["dtype=bfloat16"]
    assert 0 < row["prepare"]["max_abs_diff"] <= 1e-2 + 1e-2 * 10  # held: atol + rtol x |fp32|
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with Client(daemon.endpoint) as client:
        answer = client.infer("bf16", x)
    expected = REFERENCE(x)
    assert answer.dtype == torch.float32 and not torch.equal(answer, expected)
    torch.testing.assert_close(answer, expected, atol=5e-2, rtol=5e-2)


def test_the_probe_judges_the_prepared_model_by_the_fp32_answers(daemon):
    # No golden file: the worker's FP32 answers became the version's golden at READY, so the
    # first probe is judged ("ok", a drift above 0), not recorded from the bfloat16 answer.
    model = next(m for m in daemon.status()["models"] if m["name"] == "bf16")
    assert model["golden"]
    probe = poll_until(lambda: (daemon.workers("bf16", "READY")[0]["probe"]
                                if daemon.workers("bf16", "READY")[0]["probe"]["ok"] is not None else None),
                       30, message="a probe verdict")
    assert probe["ok"] and probe["reason"] == "ok", probe
    assert 0 < probe["drift"] <= 0.11


def test_a_model_past_its_tolerance_in_bfloat16_never_goes_ready(daemon):
    row = failure_of(daemon, "cancel")
    match = re.search(r"^prepare: dtype=bfloat16: max \|prepared - fp32\| = ([0-9.e+-]+) on the "
                      r"probe input, past atol 0.01 \+ rtol 0.01 x \|fp32\|; not going READY$", row["error"])
    assert match, row["error"]
    assert float(match.group(1)) > 0.1  # noise of ~scale/128 where FP32 is within 1e-4
    poll_until(lambda: daemon.workers("cancel")[0]["state"] == "FATAL", 60, message="cancel FATAL")
    assert daemon.workers("cancel")[0]["last_exit"] == EXIT_NAMES[EXIT_PREPARE_ERROR]
    assert not daemon.workers("cancel", "READY")


def test_freeze_of_a_module_that_is_not_torchscript_is_a_prepare_error(daemon):
    row = failure_of(daemon, "unfreezable")
    assert row["error"].startswith("prepare: freeze: the source gave a Sequential, not a TorchScript module")


@pytest.mark.parametrize("model, steps", [("compiled", ["compile(mode=default)"]), ("frozen", ["freeze"])])
def test_compiled_and_frozen_models_serve_correct_answers(daemon, model, steps):
    row = daemon.workers(model, "READY")[0]
    assert row["prepare"]["steps"] == steps and row["prepare"]["max_abs_diff"] <= 1e-5
    with Client(daemon.endpoint) as client:
        for rows in (1, 3, 7):  # new batch sizes after warm-up: a compiled model recompiles
            x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(client.infer(model, x), TINY(x), atol=1e-5, rtol=1e-5)


def test_hello_lists_the_outputs_learned_from_warm_up(daemon):
    with Client(daemon.endpoint) as client:
        models = {entry["name"]: entry for entry in client.hello()["models"]}
    assert models["plain"]["outputs"] == [{"name": "output__0", "dtype": "float32", "shape": [-1, 4]}]
    assert models["plain"]["outputs_declared"] is False
    assert models["bf16"]["outputs"] == [{"name": "output__0", "dtype": "float32", "shape": [-1, 10]}]
    assert models["cancel"]["outputs"] == []  # never READY: nothing learned
