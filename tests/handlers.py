"""Handlers and a token model the handler and bucket tests serve (faulty behaviours live here,
never in the package).

``TokenModel``: ids int64 [n, L] and mask [n, L] -> {"pooled": the masked mean of each row's
embeddings [n, 4], "tokens": every position's embedding times its mask [n, L, 4]}. Each row
depends only on its own real positions, so a padded, batched answer equals the answer alone.
An id equal to GATE blocks while the gate file exists (tests queue requests behind it). With
``first_use_ms`` the first forward at each input shape takes that much longer, as a kernel
library tuning itself per shape does (oneDNN, cuDNN, torch.compile): what real-shape warm-up
exists to pay before READY.
"""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from modelwarden.handler import BadInput, Handler

GATE = 999
MARKER = 13  # a first id of 13 makes TokenHandler.postprocess raise for that request
VOCAB = 1000


class TokenModel(nn.Module):
    def __init__(self, gate: str | None = None, first_use_ms: float = 0.0) -> None:
        super().__init__()
        self.gate = gate
        self.first_use_s = first_use_ms / 1000
        self.seen: set = set()
        self.embedding = nn.Embedding(VOCAB, 4)
        with torch.no_grad():
            self.embedding.weight.copy_(torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(3)))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        if self.gate is not None and bool((ids == GATE).any()):
            while os.path.exists(self.gate):
                threading.Event().wait(0.005)  # busy for as long as the test holds the gate
        if self.first_use_s and tuple(ids.shape) not in self.seen:
            self.seen.add(tuple(ids.shape))
            threading.Event().wait(self.first_use_s)  # "tuning" for a shape seen the first time
        keep = mask.unsqueeze(-1).to(torch.float32)
        tokens = self.embedding(ids) * keep
        pooled = tokens.sum(1) / keep.sum(1).clamp(min=1)
        return {"pooled": pooled, "tokens": tokens}


def make_token_model(gate: str | None = None, first_use_ms: float = 0.0) -> TokenModel:
    return TokenModel(gate, first_use_ms)


class TokenHandler(Handler):
    """Tensors in, tensors and a number out. preprocess takes {"ids": int64 [n, L]} (no mask:
    the worker builds it from the bucket config), refuses ids outside the vocabulary with
    BadInput."""

    def load(self, device, threads: int, gate: str | None = None, first_use_ms: float = 0.0) -> None:
        self.model = TokenModel(gate, first_use_ms).to(device).eval()
        self.threads = threads

    def preprocess(self, inputs):
        ids = inputs["ids"] if isinstance(inputs, dict) else inputs
        if isinstance(ids, list):  # a JSON request (the probe's file)
            ids = torch.tensor(ids, dtype=torch.int64)
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2:
            raise BadInput("ids must be an int64 tensor [n, L]")
        if bool((ids < 0).any()) or bool((ids >= VOCAB).any()):
            raise BadInput(f"ids must be in [0, {VOCAB})")
        return {"ids": ids}

    def forward(self, batch):
        mask = batch.get("mask")
        if mask is None:  # alone and unpadded: every position is real
            mask = torch.ones_like(batch["ids"])
        return self.model(batch["ids"], mask)

    def postprocess(self, outputs):
        return {"pooled": outputs["pooled"], "tokens": outputs["tokens"],
                "threads": self.threads}


class MarkedTokenHandler(TokenHandler):
    """TokenHandler whose postprocess raises for a request whose first id is MARKER."""

    def preprocess(self, inputs):
        batch = super().preprocess(inputs)
        marked = int(batch["ids"][0, 0] == MARKER)
        return {**batch, "marked": torch.full((batch["ids"].shape[0],), marked)}

    def forward(self, batch):
        return {**super().forward(batch), "marked": batch["marked"]}

    def postprocess(self, outputs):
        if bool(outputs["marked"].any()):
            raise RuntimeError("postprocess refuses the marked request")
        return super().postprocess({key: value for key, value in outputs.items() if key != "marked"})


def reference(handler_class: type, inputs, threads: int = 1) -> dict:
    """The handler's answer in-process, alone: what a worker of ``threads`` threads must give
    back."""
    handler = handler_class()
    handler.load(torch.device("cpu"), threads)
    with torch.inference_mode():
        return handler.postprocess(handler.forward(handler.preprocess(inputs)))


class LabelHandler(Handler):
    """str in, JSON-like out: each text's characters become ids (code point % VOCAB), padded
    within the request with a mask; the answer is, per text, a label ("long"/"short") from
    its pooled embedding's sign, its length and a float score."""

    def load(self, device, threads: int, gate: str | None = None) -> None:
        self.model = TokenModel(gate).to(device).eval()

    def preprocess(self, inputs):
        texts = inputs["texts"] if isinstance(inputs, dict) else inputs
        if isinstance(texts, str):
            texts = [texts]
        if not texts or not all(isinstance(text, str) and text for text in texts):
            raise BadInput("texts must be a non-empty list of non-empty str")
        longest = max(len(text) for text in texts)
        ids = torch.zeros((len(texts), longest), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(texts):
            ids[row, :len(text)] = torch.tensor([ord(char) % VOCAB for char in text])
            mask[row, :len(text)] = 1
        return {"ids": ids, "mask": mask}

    def forward(self, batch):
        outputs = self.model(batch["ids"], batch["mask"])
        return {"pooled": outputs["pooled"], "length": batch["mask"].sum(1)}

    def postprocess(self, outputs):
        scores = outputs["pooled"].sum(1)
        return {"labels": ["positive" if score > 0 else "negative" for score in scores.tolist()],
                "lengths": outputs["length"], "score": float(scores.sum())}


class ImageHandler(Handler):
    """bytes in: each element a binary PGM image ("P5 W H 255\\n" + W*H bytes) of any size,
    decoded in preprocess and resized to 8x8; out: 3 class scores per image and the best. A
    1x1 image blocks the forward while the gate file exists."""

    def load(self, device, threads: int, gate: str | None = None) -> None:
        self.gate = gate
        generator = torch.Generator().manual_seed(5)
        self.model = nn.Linear(64, 3).to(device).eval()
        with torch.no_grad():
            self.model.weight.copy_(torch.randn(3, 64, generator=generator))
            self.model.bias.copy_(torch.randn(3, generator=generator))

    def preprocess(self, inputs):
        images = inputs["images"] if isinstance(inputs, dict) else inputs
        gated = [isinstance(blob, bytes) and blob.startswith(b"P5 1 1 ") for blob in images]
        return {"pixels": torch.stack([decode_pgm(blob) for blob in images]),
                "gated": torch.tensor(gated)}

    def forward(self, batch):
        if self.gate is not None and bool(batch["gated"].any()):
            while os.path.exists(self.gate):
                threading.Event().wait(0.005)
        return {"scores": self.model(batch["pixels"])}

    def postprocess(self, outputs):
        return {"scores": outputs["scores"], "best": outputs["scores"].argmax(1)}


def encode_pgm(pixels: torch.Tensor) -> bytes:
    height, width = pixels.shape
    return f"P5 {width} {height} 255\n".encode() + bytes(pixels.to(torch.uint8).flatten().tolist())


def decode_pgm(blob) -> torch.Tensor:
    """An 8x8 float image from a binary PGM; BadInput for anything else."""
    if not isinstance(blob, bytes) or not blob.startswith(b"P5 "):
        raise BadInput("each image must be a binary PGM (P5)")
    header, _, data = blob.partition(b"\n")
    try:
        _, width, height, _ = header.split()
        width, height = int(width), int(height)
    except ValueError:
        raise BadInput("a PGM header is 'P5 W H 255'") from None
    if len(data) != width * height or not 0 < width * height <= 1 << 20:
        raise BadInput(f"a {width}x{height} PGM needs {width * height} pixel bytes, got {len(data)}")
    image = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, 1, height, width)
    return torch.nn.functional.interpolate(image.float() / 255, size=(8, 8)).flatten()
