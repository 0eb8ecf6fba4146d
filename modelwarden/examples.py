"""Small models that need no download, shipped in the wheel: the production config
(systemd/modelwarden.toml), `make run`, the README's walk-through and the bench serve them as
``python:modelwarden.examples:make_mlp``.

Weights come from a fixed seed, so every worker (and a test computing the same model in-process)
holds bit-identical parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def make_mlp(in_features: int = 64, hidden: int = 256, out_features: int = 10,
             seed: int = 0, empty: bool = False) -> nn.Module:
    """A two-layer perceptron: x [N, in_features] -> logits [N, out_features]. ``empty``: built
    on the meta device, no memory and no initialisation: its weights must come from the model's
    ``weights_file`` (the worker refuses to load it otherwise)."""
    if empty:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, out_features))
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


class Identity(nn.Module):
    """forward(x) = x: the same tensor, no copy. Measures pure transport cost."""

    def forward(self, *inputs):
        return inputs[0] if len(inputs) == 1 else inputs


def make_identity() -> nn.Module:
    return Identity()
