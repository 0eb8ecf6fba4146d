"""Test models for ``[models.prepare]`` (tests/test_prepare.py); never in product code.

``make_cancelling(scale=...)``: y = (x * scale + x) - x * scale. In float32 the two large terms
cancel to within ~1e-7 x scale of x; in bfloat16 (8 bits of mantissa) x * scale is rounded to a
spacing of ~scale / 128, so what is left of x is noise of that size: a model whose answers depend
on tiny differences, which a reduced precision changes past any sensible tolerance.

``make_tiny``: a two-layer perceptron small enough for torch.compile to compile in seconds.
``make_scripted``: the same as TorchScript, from a python: source (freeze accepts it).
"""

from __future__ import annotations

import torch
from torch import nn


class Cancelling(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x * self.scale
        return (big + x) - big


def make_cancelling(scale: float = 1000.0) -> nn.Module:
    return Cancelling(scale)


def make_tiny(features: int = 8, hidden: int = 16, outputs: int = 4) -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


def make_scripted(features: int = 8) -> torch.jit.ScriptModule:
    return torch.jit.script(make_tiny(features).eval())
