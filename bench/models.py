"""The serving benchmark's models (bench/serving.py): torch only, so that every peer's own
virtualenv can build the same architecture and load the same weights.

    source = "python:bench.models:make_mlp"     # W1 small: 64 -> 256 -> 10
    source = "python:bench.models:make_busy"    # W2 busy: a chain of width x width matmuls
    source = "python:bench.models:make_identity"  # W3 big: forward(x) = x
    source = "python:bench.models:make_slow_loading"  # bench/recovery.py: a ~1 s load

Weights come from a fixed seed. The peers do not rely on the seed alone: the benchmark writes
each model's state dict to a file and the peer's server loads it (``load_model``).
"""

from __future__ import annotations

import time

import torch
from torch import nn

BUSY_WIDTH = 512


def _seeded(model: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def make_mlp(in_features: int = 64, hidden: int = 256, out_features: int = 10,
             seed: int = 0) -> nn.Module:
    """x [N, 64] -> logits [N, 10]."""
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
    return _seeded(model, seed)


def make_slow_loading(load_seconds: float = 1.0, hidden: int = 256, seed: int = 0) -> nn.Module:
    """The W1 MLP behind a load that takes ``load_seconds`` (a bigger model's read and
    deserialisation, stood in for by a wait): bench/recovery.py's model."""
    time.sleep(load_seconds)
    return make_mlp(hidden=hidden, seed=seed)


def make_busy(depth: int = 8, width: int = BUSY_WIDTH, seed: int = 0) -> nn.Module:
    """x [N, width] -> [N, 10] through ``depth`` width x width layers: at batch 1 each layer is a
    matrix-vector product bound by reading its weights, so a batch of 16 costs far less than 16
    forwards (the case dynamic batching exists for)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return _seeded(nn.Sequential(*layers, nn.Linear(width, 10)), seed)


class Identity(nn.Module):
    """forward(x) = x: pure transport cost."""

    def forward(self, x):
        return x


def make_identity() -> nn.Module:
    return Identity()


FACTORIES = {"mlp": make_mlp, "busy": make_busy, "identity": make_identity}


def load_model(spec: dict) -> nn.Module:
    """The model a peer serves: ``{"kind", "kwargs", "state"}`` as bench/serving.py writes it."""
    model = FACTORIES[spec["kind"]](**spec.get("kwargs", {}))
    if spec.get("state"):
        model.load_state_dict(torch.load(spec["state"], weights_only=True))
    return model.eval()
