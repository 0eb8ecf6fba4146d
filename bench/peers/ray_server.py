"""Ray Serve peer: Ray's HTTP proxy, 2 replicas x 1 CPU (1 torch thread), raw float32 bytes.

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=1 python ray_server.py --port 8123

Batching: ``@serve.batch(max_batch_size, batch_wait_timeout_s)``. Runs until SIGTERM, then
shuts Serve and Ray down (its raylet and GCS are processes of their own).
"""

from __future__ import annotations

import argparse
import os
import signal

import ray
from common import exit_on_sigterm, forward_batch, from_bytes, one_thread_model, spec, to_bytes
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

BATCH = int(os.environ.get("BENCH_MAX_BATCH", "1"))
WAIT_S = int(os.environ.get("BENCH_WAIT_MS", "0")) / 1000


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
class Infer:
    def __init__(self) -> None:
        self.model = one_thread_model()
        self.shape = spec()["input_shape"]

    @serve.batch(max_batch_size=max(BATCH, 1), batch_wait_timeout_s=WAIT_S)
    async def batched(self, inputs: list):
        return forward_batch(self.model, inputs)

    async def __call__(self, request: Request) -> Response:
        x = from_bytes(await request.body(), self.shape)
        y = await self.batched(x) if BATCH > 1 else forward_batch(self.model, [x])[0]
        return Response(to_bytes(y), media_type="application/octet-stream")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    exit_on_sigterm()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Infer.bind(), route_prefix="/")
        signal.pause()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
