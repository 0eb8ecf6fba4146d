"""PyTriton serving the W4 text example: KServe v2 with a BYTES input "texts" [n, 1] and an FP32
output "logits" [n, 2], 2 model instances x 1 torch thread, Triton's dynamic batcher
(max_batch_size, max_queue_delay_microseconds).

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=2 python text_pytriton_server.py --port 8123
"""

from __future__ import annotations

import argparse

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
from pytriton_server import use_our_libpython
from text_common import TextModel, batch_settings
from common import exit_on_sigterm

BATCH, WAIT_MS = batch_settings()


def infer_function(model: TextModel):
    @batch
    def infer(texts):  # object array [n, 1] of bytes: every request of the batch, joined
        strings = [row[0].decode("utf-8") for row in texts]
        return {"logits": np.asarray(model.logits(strings), dtype=np.float32)}

    return infer


def main() -> None:
    use_our_libpython()
    exit_on_sigterm()  # SIGTERM leaves through the with block: Triton is stopped, not orphaned
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    models = [TextModel() for _ in range(2)]
    config = ModelConfig(batching=True, max_batch_size=BATCH,
                         batcher=DynamicBatcher(max_queue_delay_microseconds=int(WAIT_MS * 1000)))
    triton_config = TritonConfig(http_address="127.0.0.1", http_port=port, allow_grpc=False,
                                 allow_metrics=False)
    with Triton(config=triton_config) as triton:
        triton.bind(model_name="text", infer_func=[infer_function(model) for model in models],
                    inputs=[Tensor(name="texts", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="logits", dtype=np.float32, shape=(2,))],
                    config=config, strict=False)
        triton.serve()


if __name__ == "__main__":
    main()
