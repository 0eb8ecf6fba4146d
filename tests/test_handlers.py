"""Handlers and length buckets, end to end: a real daemon, real workers, requests queued behind a
worker held busy (tests/handlers.py's GATE id), then taken as one batch. Nothing sleeps to
synchronise."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from modelwarden import Client
from modelwarden.shared.errors import BadInput, ModelError
from tests.handlers import GATE, MARKER, MarkedTokenHandler, TokenHandler, reference
from tests import helpers
from tests.helpers import Daemon

WAIT = 60
BUCKETS = [8, 16, 32]


def token_model(tmp_path, source: str = "handler:tests.handlers:TokenHandler",
                batching: dict | None = None, **extra) -> dict:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"ids": [[5, 6, 7, 8, 9]]}))
    model = {"name": "tok", "source": source, "kwargs": {"gate": str(tmp_path / "gate")},
             "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 6,
             "probe": {"interval": 0, "input": str(probe)},
             "batching": {"max_size": 8, "buckets": BUCKETS, "pad": {"ids": 0, "mask": 0},
                          "mask": "mask", "keep_length": ["tokens"], **(batching or {})}}
    model.update(extra)
    return model


def ids(length: int, seed: int, first: int | None = None) -> torch.Tensor:
    row = torch.randint(1, 900, (1, length), generator=torch.Generator().manual_seed(seed))
    if first is not None:
        row[0, 0] = first
    return row


def Gate(daemon: Daemon, client: Client, tmp_path) -> helpers.Gate:
    """The only worker of 'tok' held busy (tests/helpers.Gate) while requests queue."""
    return helpers.Gate(daemon, client, 'tok', {"ids": ids(3, 0, first=GATE)}, tmp_path / "gate", WAIT)


def assert_answers(outputs: dict, expected: dict) -> None:
    assert set(outputs) == set(expected), (set(outputs), set(expected))
    for name, value in expected.items():
        got = outputs[name]
        if isinstance(value, torch.Tensor):
            assert got.shape == value.shape, (name, got.shape, value.shape)
            assert torch.allclose(got, value, atol=1e-5), name
        else:
            assert int(got) == value, (name, got, value)


def test_a_handlers_answer_equals_the_same_handler_run_in_process(tmp_path):
    model = token_model(tmp_path)
    model["batching"] = {"max_size": 1}
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            for seed, length in enumerate([1, 5, 17]):
                request = {"ids": ids(length, seed)}
                assert_answers(client.infer("tok", request), reference(TokenHandler, request))
            assert client.infer("tok", {"ids": ids(4, 9)})["threads"] == 1  # load() got the worker's


def test_members_of_different_lengths_in_one_bucket_share_a_forward_and_keep_their_own_answers(tmp_path):
    with Daemon([token_model(tmp_path)]) as daemon:
        daemon.wait_ready()
        lengths = [9, 12, 16, 20]  # bucket 16 three times, then bucket 32
        requests = [{"ids": ids(length, seed)} for seed, length in enumerate(lengths, start=1)]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = [client.submit("tok", request, timeout=WAIT, details=True)
                           for request in requests]
                gate.queue(len(requests))
            replies = [future.result(WAIT) for future in futures]
        assert [reply.timing["batch"] for reply in replies] == [3, 3, 3, 1]
        for reply, request, length in zip(replies, requests, lengths):
            expected = reference(TokenHandler, request)
            assert reply.outputs["tokens"].shape == (1, length, 4)  # its own length, not 16
            assert_answers(reply.outputs, expected)


def test_a_plain_model_with_buckets_gets_its_mask_built_or_padded(tmp_path):
    model = token_model(tmp_path, source="python:tests.handlers:make_token_model", warmup=0)
    model.pop("probe")
    model["probe"] = {"interval": 0}
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            short, long = ids(5, 1), ids(14, 2)
            with Gate(daemon, client, tmp_path) as gate:
                built = client.submit("tok", {"ids": short}, timeout=WAIT, details=True)
                sent = client.submit("tok", {"ids": long, "mask": torch.ones_like(long)},
                                     timeout=WAIT, details=True)
                gate.queue(2)
            built, sent = built.result(WAIT), sent.result(WAIT)
        # the two differ in their trees (one sends the mask): two batches, each padded right
        for reply, row in ((built, short), (sent, long)):
            expected = reference(TokenHandler, {"ids": row})
            assert_answers(reply.outputs, {k: v for k, v in expected.items() if k != "threads"})


def test_one_members_bad_input_or_failing_postprocess_fails_only_that_member(tmp_path):
    model = token_model(tmp_path, source="handler:tests.handlers:MarkedTokenHandler")
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        requests = [{"ids": ids(10, 1)}, {"ids": -ids(11, 2)}, {"ids": ids(12, 3, first=MARKER)},
                    {"ids": ids(13, 4)}]
        with Client(daemon.endpoint) as client:
            with Gate(daemon, client, tmp_path) as gate:
                futures = [client.submit("tok", request, timeout=WAIT, details=True)
                           for request in requests]
                gate.queue(len(requests))
            good_first, good_last = futures[0].result(WAIT), futures[3].result(WAIT)
            with pytest.raises(BadInput, match=r"ids must be in \[0, 1000\)"):
                futures[1].result(WAIT)
            with pytest.raises(ModelError, match="postprocess refuses the marked request"):
                futures[2].result(WAIT)
        for reply, request in ((good_first, requests[0]), (good_last, requests[3])):
            assert reply.timing["batch"] == 3  # the marked member ran in the batch, the bad one never
            expected = reference(MarkedTokenHandler, request)
            assert_answers(reply.outputs, expected)


@pytest.mark.parametrize("too_long", ["refuse", "truncate"])
def test_a_member_past_the_last_bucket_is_refused_or_truncated_as_declared(tmp_path, too_long):
    with Daemon([token_model(tmp_path, batching={"too_long": too_long})]) as daemon:
        daemon.wait_ready()
        request = {"ids": ids(40, 5)}
        with Client(daemon.endpoint) as client:
            if too_long == "refuse":
                with pytest.raises(BadInput, match=r"length 40 .* past the last bucket \(32\)"):
                    client.infer("tok", request)
            else:
                outputs = client.infer("tok", request)
                cut = {"ids": request["ids"][:, :32]}
                assert_answers(outputs, reference(TokenHandler, cut))
            assert client.infer("tok", {"ids": ids(6, 6)})["tokens"].shape == (1, 6, 4)


def test_warm_up_runs_every_bucket_at_batch_one_and_max_size_before_ready(tmp_path):
    # The model pays 50 ms the first time it sees a shape: a warm-up at the wrong shapes leaves
    # that cost to the first request after READY.
    model = token_model(tmp_path, warmup=12)
    model["kwargs"]["first_use_ms"] = 50
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        worker = daemon.workers("tok")[0]
        each = 12 // (len(BUCKETS) * 2)
        assert worker["warmup"] == {str(edge): {"1": each, "8": each} for edge in BUCKETS}
        assert "READY on cpu[0] with 1 thread(s) after 12 warm-up forward(s)" in daemon.log()
        with Client(daemon.endpoint) as client:  # a full batch at the longest bucket, first
            request = {"ids": ids(32, 7).repeat(8, 1)}
            times = [client.infer("tok", request, details=True).timing["compute_us"]
                     for _ in range(9)]
        steady = statistics.median(times[1:])
        assert times[0] <= 3 * steady + 10_000, times  # 50 ms of "tuning" would show


def gated_model(tmp_path, name: str, source: str, probe: object, **batching) -> dict:
    probe_file = tmp_path / f"{name}.json"
    probe_file.write_text(json.dumps(probe))
    return {"name": name, "source": source, "kwargs": {"gate": str(tmp_path / "gate")},
            "workers": 1, "cores_per_worker": 1, "threads": 1, "warmup": 2,
            "probe": {"interval": 0, "input": str(probe_file)},
            "batching": {"max_size": 8, **batching}}


def queued_batch(daemon: Daemon, client: Client, tmp_path, name: str, gate_request,
                 requests: list) -> list:
    """Every request's reply, all queued behind ``gate_request`` (which holds the worker)."""
    with helpers.Gate(daemon, client, name, gate_request, tmp_path / "gate", WAIT) as gate:
        futures = [client.submit(name, request, timeout=WAIT, details=True) for request in requests]
        gate.queue(len(requests))
    return [future.result(WAIT) for future in futures]


def test_a_str_handler_answers_json_like_values_and_a_bucket_batch_equals_each_alone(tmp_path):
    from tests.handlers import LabelHandler

    model = gated_model(tmp_path, "label", "handler:tests.handlers:LabelHandler", ["probe text"],
                        buckets=[8, 16, 32], pad={"ids": 0, "mask": 0}, mask="mask",
                        bytes_per_token=1.0)
    requests = [["hello world"], ["good morning all", "ok"], ["twelve chars"],  # bucket 16
                ["this one is rather longer text"]]                              # bucket 32
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            replies = queued_batch(daemon, client, tmp_path, "label", [chr(GATE) + "ab"], requests)
            with pytest.raises(BadInput, match="non-empty list of non-empty str"):
                client.infer("label", ["fine", ""])
        assert [reply.timing["batch"] for reply in replies] == [3, 3, 3, 1]
        for reply, texts in zip(replies, requests):
            expected = reference(LabelHandler, texts)
            assert reply.outputs["labels"] == expected["labels"]
            assert reply.outputs["lengths"].tolist() == expected["lengths"].tolist()
            assert reply.outputs["score"].dtype == torch.float64 and reply.outputs["score"].dim() == 0
            assert abs(float(reply.outputs["score"]) - expected["score"]) < 1e-4


def test_a_bytes_handler_decodes_images_in_preprocess_and_a_bad_one_fails_alone(tmp_path):
    from tests.handlers import ImageHandler, encode_pgm

    def image(height: int, width: int, seed: int) -> bytes:
        generator = torch.Generator().manual_seed(seed)
        return encode_pgm(torch.randint(0, 256, (height, width), generator=generator))

    model = gated_model(tmp_path, "images", "handler:tests.handlers:ImageHandler", [])
    model.update(warmup=0, probe={"interval": 0})
    requests = [[image(8, 8, 1)], [image(16, 12, 2), image(5, 9, 3)], [b"not an image"],
                [image(30, 30, 4)]]
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint) as client:
            with helpers.Gate(daemon, client, "images", [image(1, 1, 0)], tmp_path / "gate",
                              WAIT) as gate:
                futures = [client.submit("images", request, timeout=WAIT, details=True)
                           for request in requests]
                gate.queue(len(requests))
            with pytest.raises(BadInput, match="binary PGM"):
                futures[2].result(WAIT)
            replies = [futures[index].result(WAIT) for index in (0, 1, 3)]
        for reply, request in zip(replies, [requests[0], requests[1], requests[3]]):
            assert reply.timing["batch"] == 3  # the bad image never reached the batch
            expected = reference(ImageHandler, request)
            assert torch.allclose(reply.outputs["scores"], expected["scores"], atol=1e-5)
            assert torch.equal(reply.outputs["best"], expected["best"])


def test_a_handlers_model_prepared_in_bfloat16_is_held_to_its_fp32_answers(tmp_path):
    # prepare applies to the handler's model; the hold runs the probe through the whole pipeline
    model = token_model(tmp_path)
    model["prepare"] = {"dtype": "bfloat16"}
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        prepared = daemon.workers("tok")[0]["prepare"]
        assert prepared["steps"] == ["dtype=bfloat16"] and 0 < prepared["max_abs_diff"] <= 0.01
        request = {"ids": ids(12, 3)}
        with Client(daemon.endpoint) as client:
            outputs = client.infer("tok", request)
        expected = reference(TokenHandler, request)
        assert outputs["pooled"].dtype == torch.float32
        assert torch.allclose(outputs["pooled"], expected["pooled"], atol=0.02)
        assert not torch.equal(outputs["pooled"], expected["pooled"])  # it did run in bfloat16
