"""mosec peer: Rust HTTP front-end, 2 Python worker processes x 1 thread, raw float32 bytes.

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=1 python mosec_server.py --port 8123

Batching: mosec's dynamic batcher (``max_batch_size``, ``max_wait_time`` in ms) hands forward a
list of requests. Health: GET / answers 200 once the workers are up.
"""

from __future__ import annotations

import os

from common import forward_batch, from_bytes, one_thread_model, spec, to_bytes
from mosec import Server, Worker


class Infer(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = one_thread_model()
        self.shape = spec()["input_shape"]

    def deserialize(self, data: bytes):
        return from_bytes(data, self.shape)

    def serialize(self, data) -> bytes:
        return to_bytes(data)

    def forward(self, data):
        if isinstance(data, list):  # batching on: a list of requests
            return forward_batch(self.model, data)
        return forward_batch(self.model, [data])[0]


if __name__ == "__main__":
    batch = int(os.environ.get("BENCH_MAX_BATCH", "1"))
    server = Server()
    server.append_worker(Infer, num=2, max_batch_size=batch,
                         max_wait_time=int(os.environ.get("BENCH_WAIT_MS", "0")) if batch > 1 else 0,
                         timeout=30)
    server.run()
