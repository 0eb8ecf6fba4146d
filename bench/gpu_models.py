"""Models for bench/gpu_check.py, served by the daemon it starts (``python:bench.gpu_models:...``).

``make_where``: forward(x) -> (2 * x, where). When x holds REPORT_MARKER, ``where`` = [device
index, the current CUDA stream's handle (0 = the legacy default stream)] as int64: each worker
says where it ran; otherwise [-1, -1], so that every worker's probe output is the same.
When x holds OOM_MARKER it asks for far more memory than any GPU has (a CUDA OOM in forward);
when x holds HOLD_MARKER it keeps ``hold_mb`` MiB of CUDA memory allocated for good (a leak the
``max_cuda_memory`` recycling must catch).

``make_busy``: ``depth`` square matmuls of ``width``: GPU time per request, for 1 vs N workers.
"""

from __future__ import annotations

import torch
from torch import nn

OOM_MARKER = 13.0
HOLD_MARKER = 17.0
REPORT_MARKER = 19.0


class Where(nn.Module):
    def __init__(self, hold_mb: int) -> None:
        super().__init__()
        self.hold_mb = hold_mb
        self.held: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor):
        if bool((x == OOM_MARKER).any()):
            torch.empty(1 << 46, dtype=torch.uint8, device=x.device)  # 64 TiB
        if bool((x == HOLD_MARKER).any()):
            self.held.append(torch.ones(self.hold_mb << 20, dtype=torch.uint8, device=x.device))
        if not bool((x == REPORT_MARKER).any()):
            return 2 * x, torch.tensor([-1, -1], dtype=torch.int64)
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        index = x.device.index if x.is_cuda else -1
        return 2 * x, torch.tensor([index, stream], dtype=torch.int64)


def make_where(hold_mb: int = 1024) -> nn.Module:
    return Where(hold_mb)


class Busy(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.Parameter(torch.randn(depth, width, width, generator=generator) / width ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = torch.tanh(x @ weight)
        return x


def make_busy(width: int = 2048, depth: int = 16) -> nn.Module:
    return Busy(width, depth)
