"""What every peer server script shares: the model spec, raw float32 bytes <-> tensors, batches.

A peer's server runs in the peer's own virtualenv with the repository root on sys.path (for
bench.models, torch only). The benchmark passes the model spec file in BENCH_SPEC:
``{"kind", "kwargs", "state", "input_shape"}`` (the shape of one request's input).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.models import load_model  # noqa: E402


def spec() -> dict:
    return json.loads(Path(os.environ["BENCH_SPEC"]).read_text())


def one_thread_model():
    """The model on one intra-op thread: 2 workers x 1 thread, like modelwarden's."""
    torch.set_num_threads(1)
    return load_model(spec())


def from_bytes(data: bytes, shape) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape))


def to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def forward_batch(model, inputs: list) -> list:
    """One forward for many requests: concatenated along dim 0, split back per request."""
    with torch.inference_mode():
        if len(inputs) == 1:
            return [model(inputs[0])]
        output = model(torch.cat(inputs))
        return list(output.split([x.shape[0] for x in inputs]))


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so the server's finally/with blocks stop what it started."""
    def leave(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
