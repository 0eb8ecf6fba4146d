"""Where a text request's bucket key should come from, measured (docs/ARCHITECTURE.md "Length
buckets" quotes what this prints).

The supervisor never decodes a payload, so it must form batches before anything is tokenised.
Two designs:
  (a) the key from the header: the longest element's byte length / ``bytes_per_token``; the
      worker tokenises each member and pads within the batch to its longest member;
  (b) preprocessing as its own stage before the batcher (mosec's pipelined stages): exact token
      counts, at the cost of one more process hop per request and a pool to run it.

This prints, on bench/text.py's seeded W4 mix: how often the estimate picks the exact bucket;
the padded positions a forward computes per real token when batches of 16 are formed by each key
(and with no buckets at all: everything padded to 128); what tokenising one text costs; and what
one more ZeroMQ hop costs (a DEALER/ROUTER round trip over ipc:// between two processes).

    .venv/bin/python bench/buckets.py [--texts 2000] [--bytes-per-token 4]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.text import make_texts, token_counts, wordpiece  # noqa: E402

EDGES = (16, 32, 64, 128)
BATCH = 16
WINDOW = 64  # requests in flight the batcher can choose among (bench/text.py's top level)


def bucket(length: int) -> int:
    return next((index for index, edge in enumerate(EDGES) if length <= edge), len(EDGES) - 1)


def padded_per_token(tokens: list[int], keys: list) -> float:
    """Positions computed per real token when a batcher (supervisor/routing/batching.pick:
    the head and its same-key followers, in order, within WINDOW) forms batches of BATCH by
    ``keys`` and the worker pads each batch to its longest member; a None key pads to 128."""
    queue = list(range(len(tokens)))
    computed = 0
    while queue:
        head = queue[0]
        members = [index for index in queue[:WINDOW] if keys[index] == keys[head]][:BATCH]
        width = EDGES[-1] if keys[head] is None else max(tokens[index] for index in members)
        computed += width * len(members)
        taken = set(members)
        queue = [index for index in queue if index not in taken]
    return computed / sum(tokens)


def _echo(endpoint: str) -> None:
    import zmq

    socket = zmq.Context().socket(zmq.ROUTER)
    socket.bind(endpoint)
    while True:
        frames = socket.recv_multipart()
        socket.send_multipart(frames)
        if frames[-1] == b"stop":
            return


def hop_us(rounds: int = 2000) -> float:
    """The median round trip of a 200-byte message to another process over ipc://."""
    import zmq

    endpoint = f"ipc://{tempfile.mkdtemp()}/hop"
    server = multiprocessing.get_context("spawn").Process(target=_echo, args=(endpoint,))
    server.start()
    socket = zmq.Context().socket(zmq.DEALER)
    socket.connect(endpoint)
    message = b"x" * 200
    samples = []
    for _ in range(rounds):
        started = time.perf_counter_ns()
        socket.send(message)
        socket.recv()
        samples.append((time.perf_counter_ns() - started) / 1000)
    socket.send(b"stop")
    socket.recv()
    server.join(10)
    return statistics.median(samples[rounds // 10:])


def tokenise_us(tokenizer, texts: list[str]) -> float:
    samples = []
    for text in texts:
        started = time.perf_counter_ns()
        tokenizer.encode(text)
        samples.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--bytes-per-token", type=float, default=4.0)
    args = parser.parse_args(argv)
    tokenizer = wordpiece()
    texts = make_texts(tokenizer, count=args.texts)
    tokens = token_counts(tokenizer, texts)
    estimated = [bucket(math.ceil(len(text.encode()) / args.bytes_per_token)) for text in texts]
    exact = [bucket(count) for count in tokens]
    same = sum(a == b for a, b in zip(estimated, exact)) / len(texts)
    off_by_more = sum(abs(a - b) > 1 for a, b in zip(estimated, exact)) / len(texts)
    bytes_per_token = sum(len(text.encode()) for text in texts) / sum(tokens)
    waste = {name: padded_per_token(tokens, keys)
             for name, keys in (("exact tokens (b)", exact), ("bytes estimate (a)", estimated),
                                ("no buckets", [None] * len(texts)))}
    print(f"{len(texts)} texts of the W4 mix, {min(tokens)}-{max(tokens)} tokens, "
          f"{bytes_per_token:.2f} bytes per token measured, estimate at {args.bytes_per_token}")
    print(f"estimate picks the exact bucket: {same:.1%}; off by more than one bucket: "
          f"{off_by_more:.1%}")
    for name, value in waste.items():
        print(f"positions computed per real token, batches of {BATCH} keyed by {name}: {value:.2f}")
    ratio = waste["bytes estimate (a)"] / waste["exact tokens (b)"]
    print(f"(a) computes {ratio:.3f}x the positions of (b); no buckets computes "
          f"{waste['no buckets'] / waste['exact tokens (b)']:.2f}x")
    print(f"tokenising one text: {tokenise_us(tokenizer, texts[:500]):.0f} us median; "
          f"one more process hop (ipc round trip): {hop_us():.0f} us median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
