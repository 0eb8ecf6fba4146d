"""LitServe serving the W4 text example: JSON {"texts": [...]} in, {"logits": [[a, b], ...]} out,
2 inference worker processes x 1 thread, LitServe's batching (max_batch_size, batch_timeout s).

    BENCH_SPEC=spec.json BENCH_MAX_BATCH=16 BENCH_WAIT_MS=2 python text_litserve_server.py --port 8123
"""

from __future__ import annotations

import argparse

import litserve as ls
from text_common import TextModel, batch_settings

BATCH, WAIT_MS = batch_settings()


class Classify(ls.LitAPI):
    def setup(self, device):
        self.model = TextModel()

    def decode_request(self, request):
        return request["texts"]

    def batch(self, inputs):
        return inputs

    def predict(self, texts):
        if BATCH > 1:  # a list of requests
            return self.model.per_request(texts)
        return self.model.logits(texts)

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        return {"logits": output}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    api = Classify(max_batch_size=BATCH, batch_timeout=WAIT_MS / 1000 if BATCH > 1 else 0.0)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=2, timeout=30)
    server.run(host="127.0.0.1", port=port, generate_client_file=False)
