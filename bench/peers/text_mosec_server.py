"""mosec serving the W4 text example: JSON {"texts": [...]} in, {"logits": [[a, b], ...]} out,
2 worker processes x 1 thread, mosec's dynamic batcher (max_batch_size, max_wait_time ms).

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=2 python text_mosec_server.py --port 8123
"""

from __future__ import annotations

import json

from mosec import Server, Worker
from text_common import TextModel, batch_settings

BATCH, WAIT_MS = batch_settings()


class Classify(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = TextModel()

    def deserialize(self, data: bytes):
        return json.loads(data)["texts"]

    def serialize(self, data) -> bytes:
        return json.dumps({"logits": data}).encode()

    def forward(self, data):
        if BATCH > 1:  # a list of requests
            return self.model.per_request(data)
        return self.model.logits(data)


if __name__ == "__main__":
    server = Server()
    server.append_worker(Classify, num=2, max_batch_size=BATCH,
                         max_wait_time=int(WAIT_MS) if BATCH > 1 else 0, timeout=30)
    server.run()
