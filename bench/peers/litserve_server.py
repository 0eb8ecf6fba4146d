"""LitServe peer: FastAPI/uvicorn front-end, 2 inference worker processes x 1 thread, JSON
bodies with the float32 bytes in base64 (LitServe decodes every request body as JSON).

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=1 python litserve_server.py --port 8123

Batching: LitServe's ``max_batch_size`` / ``batch_timeout`` (seconds). Health: GET /health.
"""

from __future__ import annotations

import argparse
import base64
import os

import litserve as ls
from common import forward_batch, from_bytes, one_thread_model, spec, to_bytes


class Infer(ls.LitAPI):
    def setup(self, device):
        self.model = one_thread_model()
        self.shape = spec()["input_shape"]

    def decode_request(self, request):
        return from_bytes(base64.b64decode(request["b64"]), self.shape)

    def batch(self, inputs):
        return inputs

    def predict(self, x):
        if isinstance(x, list):  # batching on: a list of requests
            return forward_batch(self.model, x)
        return forward_batch(self.model, [x])[0]

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        return {"b64": base64.b64encode(to_bytes(output)).decode()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    batch = int(os.environ.get("BENCH_MAX_BATCH", "1"))
    api = Infer(max_batch_size=batch,
                batch_timeout=int(os.environ.get("BENCH_WAIT_MS", "0")) / 1000 if batch > 1 else 0.0)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=2, timeout=30)
    server.run(host="127.0.0.1", port=port, generate_client_file=False)
