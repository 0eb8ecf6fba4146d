"""What the text peers (W4, bench/text.py) share: the example's model, tokenizer and head.

Runs in a peer's own virtualenv (torch, tokenizers; not modelwarden): the benchmark writes the
spec in BENCH_SPEC, ``{"minilm": path of modelwarden/minilm.py, "state": its state dict (.pt),
"prototypes": the head's class embeddings (.pt), "scale", "tokenizer": tokenizer.json}``, all
taken from the example service it measures, so every peer answers what modelwarden answers.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch


def spec() -> dict:
    return json.loads(Path(os.environ["BENCH_SPEC"]).read_text())


def _minilm_module(path: str):
    """modelwarden/minilm.py by its path: it imports torch alone (modelwarden is not here)."""
    found = importlib.util.spec_from_file_location("bench_minilm", path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


class TextModel:
    """texts -> logits [n][2]: tokenised together, padded to the longest (what a user of a
    batching server writes), all-MiniLM-L6-v2, scale x cosine to each class's prototypes."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        torch.set_num_threads(1)  # 2 workers x 1 thread, like modelwarden's
        found = spec()
        self.model = _minilm_module(found["minilm"]).MiniLM()
        self.model.load_state_dict(torch.load(found["state"], weights_only=True))
        self.model.eval()
        self.prototypes = torch.load(found["prototypes"], weights_only=True)
        self.scale = float(found["scale"])
        self.tokenizer = Tokenizer.from_file(found["tokenizer"])
        self.tokenizer.enable_truncation(max_length=128)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")

    def logits(self, texts: list[str]) -> list[list[float]]:
        encoded = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([item.ids for item in encoded], dtype=torch.int64)
        mask = torch.tensor([item.attention_mask for item in encoded], dtype=torch.int64)
        with torch.inference_mode():
            embeddings = self.model(ids, mask)
            return (self.scale * embeddings @ self.prototypes.T).tolist()

    def per_request(self, requests: list[list[str]]) -> list[list[list[float]]]:
        """One forward for many requests (each a list of texts), split back per request."""
        rows = self.logits([text for texts in requests for text in texts])
        out, start = [], 0
        for texts in requests:
            out.append(rows[start:start + len(texts)])
            start += len(texts)
        return out


def batch_settings() -> tuple[int, float]:
    """(max batch size, wait in ms) from the environment the benchmark sets."""
    return int(os.environ.get("BENCH_MAX_BATCH", "16")), float(os.environ.get("BENCH_WAIT_MS", "2"))
