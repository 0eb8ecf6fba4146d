"""Closed-loop HTTP/1.1 keep-alive load on one peer, run with the peer's own python.

    python httpload.py --url URL --format bytes|json-b64|triton --data inputs.pt --concurrency 8 \
        --warmup 1 --duration 5

The client is httpx (mosec's documented client) in a thread pool: one thread and one keep-alive
``httpx.Client`` per request in flight. (httpx's AsyncClient was measured here at a quarter of
the throughput of the threads at 8 in flight, the client itself the bottleneck.)
``inputs.pt`` holds ``{"inputs": [...], "expected": [...], "atol", "rtol"}``: request i sends
inputs[i % n], and a sample of answers is compared with expected[i % n]. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading

from common import from_bytes, to_bytes  # also puts the repository root on sys.path

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.loadgen import Window, run_threads  # noqa: E402


def triton_request(x) -> dict:
    """KServe v2 with Triton's binary tensor extension (what tritonclient's HTTP client sends)."""
    raw = to_bytes(x)
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    return {"content": header + raw,
            "headers": {"content-type": "application/octet-stream",
                        "inference-header-content-length": str(len(header))}}


def triton_output(response, shape):
    start = int(response.headers.get("inference-header-content-length", len(response.content)))
    return from_bytes(response.content[start:], shape)


def encoders(fmt: str):
    if fmt == "triton":
        return triton_request, triton_output
    if fmt == "bytes":
        return (lambda x: {"content": to_bytes(x),
                           "headers": {"content-type": "application/octet-stream"}},
                lambda response, shape: from_bytes(response.content, shape))
    return (lambda x: {"json": {"b64": base64.b64encode(to_bytes(x)).decode()}},
            lambda response, shape: from_bytes(base64.b64decode(response.json()["b64"]), shape))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--format", choices=("bytes", "json-b64", "triton"), default="bytes")
    parser.add_argument("--data", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()
    data = torch.load(args.data, weights_only=True)
    encode, decode = encoders(args.format)
    bodies = [encode(x) for x in data["inputs"]]
    expected = data["expected"]
    shapes = [tuple(y.shape) for y in expected]

    def check(index: int, output) -> bool:
        return torch.allclose(output, expected[index], atol=data["atol"], rtol=data["rtol"])

    window = Window(args.warmup, args.duration)
    local = threading.local()

    def call(index: int):
        client = getattr(local, "client", None)
        if client is None:  # one keep-alive connection per client thread
            client = local.client = httpx.Client(timeout=30)
        response = client.post(args.url, **bodies[index])
        response.raise_for_status()
        return decode(response, shapes[index])

    print(json.dumps(run_threads(call, args.concurrency, window, len(bodies), check)))


if __name__ == "__main__":
    main()
