"""Closed-loop HTTP/1.1 keep-alive load of W4 texts on one peer, run with the peer's own python.

    python textload.py --url URL --format json|triton --data texts.json --concurrency 16 \
        --warmup 1 --duration 4

Like httpload.py (httpx, one thread and keep-alive connection per request in flight), with one
text per request: ``texts.json`` holds ``{"texts": [...], "expected": [[a, b], ...], "atol"}``;
request i sends texts[i % n] and a sample of answers is compared with expected[i % n].
``json``: mosec's and LitServe's body {"texts": [text]}; ``triton``: KServe v2 JSON with a BYTES
tensor. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import httpx  # noqa: E402

from bench.loadgen import Window, run_threads  # noqa: E402


def body(fmt: str, text: str) -> dict:
    if fmt == "triton":
        return {"json": {"inputs": [{"name": "texts", "shape": [1, 1], "datatype": "BYTES",
                                     "data": [text]}]}}
    return {"json": {"texts": [text]}}


def logits(fmt: str, response) -> list[float]:
    if fmt == "triton":
        return response.json()["outputs"][0]["data"]
    return response.json()["logits"][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--format", choices=("json", "triton"), default="json")
    parser.add_argument("--data", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args()
    data = json.loads(Path(args.data).read_text())
    bodies = [body(args.format, text) for text in data["texts"]]
    expected, atol = data["expected"], data["atol"]

    def check(index: int, output) -> bool:
        return all(abs(a - b) <= atol for a, b in zip(output, expected[index], strict=True))

    local = threading.local()

    def call(index: int):
        client = getattr(local, "client", None)
        if client is None:  # one keep-alive connection per client thread
            client = local.client = httpx.Client(timeout=60)
        response = client.post(args.url, **bodies[index])
        response.raise_for_status()
        return logits(args.format, response)

    window = Window(args.warmup, args.duration)
    print(json.dumps(run_threads(call, args.concurrency, window, len(bodies), check)))


if __name__ == "__main__":
    main()
