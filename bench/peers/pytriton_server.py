"""PyTriton peer: NVIDIA Triton's HTTP front-end (C++), 2 model instances x 1 torch thread (the
Python callables run in this process, one thread each), KServe v2 binary tensors.

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=1 python pytriton_server.py --port 8123

Batching: Triton's dynamic batcher (``max_batch_size``, ``max_queue_delay_microseconds``);
off: ``batching=False``, each request alone. Health: GET /v2/health/ready.
"""

from __future__ import annotations

import argparse
import os
import sysconfig

import numpy as np
import torch
from common import exit_on_sigterm, one_thread_model, spec
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

BATCH = int(os.environ.get("BENCH_MAX_BATCH", "1"))
WAIT_US = int(os.environ.get("BENCH_WAIT_MS", "0")) * 1000


def infer_function(model):
    @batch
    def infer(x):
        with torch.inference_mode():
            return {"y": model(torch.from_numpy(x)).numpy()}

    return infer


def use_our_libpython() -> None:
    """Triton's Python stub links libpython3.X.so by name: without this it may load the system's
    copy (another patch release) against this interpreter's standard library, and fail."""
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))


def main() -> None:
    use_our_libpython()
    # SIGTERM leaves through the with block: Triton's server is stopped, not orphaned.
    exit_on_sigterm()
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    shape = spec()["input_shape"]
    models = [one_thread_model() for _ in range(2)]
    with torch.inference_mode():
        out_shape = list(models[0](torch.zeros(shape)).shape)
    if BATCH > 1:
        dims_in, dims_out = shape[1:], out_shape[1:]
        config = ModelConfig(batching=True, max_batch_size=BATCH,
                             batcher=DynamicBatcher(max_queue_delay_microseconds=WAIT_US))
    else:
        dims_in, dims_out = shape, out_shape
        config = ModelConfig(batching=False)
    triton_config = TritonConfig(http_address="127.0.0.1", http_port=port, allow_grpc=False,
                                 allow_metrics=False)
    with Triton(config=triton_config) as triton:
        triton.bind(model_name="bench", infer_func=[infer_function(model) for model in models],
                    inputs=[Tensor(name="x", dtype=np.float32, shape=tuple(dims_in))],
                    outputs=[Tensor(name="y", dtype=np.float32, shape=tuple(dims_out))],
                    config=config, strict=False)
        triton.serve()


if __name__ == "__main__":
    main()
