"""all-MiniLM-L6-v2 served by examples/minilm.toml: latency alone, throughput with batching.

    python bench/minilm.py [--workers 2] [--seconds 10] [--length 32]

Starts the daemon on examples/minilm.toml (its workers, threads, batching and probe; the
runtime directory and worker count overridden) and measures, closed loop (bench/loadgen.py):
  1 in flight     one caller, Client.infer: p50 and p99 latency, requests/s
  64 in flight    64 tasks on one AsyncClient: requests/s (sentences/s), p50/p99, the mean
                  batch size the daemon formed
and the same model in this process, one sentence at a time and 16 at a time (1 thread), for
scale. Every 25th answer is checked against the in-process model. Sentences are tokenised once,
padded to ``--length`` tokens (tokenisation is the client's cost, not the server's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Window, run_async, run_threads  # noqa: E402

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The new movie is awesome.", "The new movie is so great.",
             "A man is playing a guitar.", "A woman is slicing an onion.",
             "Two dogs play in the snow.", "The stock market fell sharply today."]


def start_daemon(workdir: Path, workers: int) -> tuple[subprocess.Popen, str]:
    from modelwarden.client.control import control_request

    env = {**os.environ, "MODELWARDEN_DAEMON__RUNTIME_DIR": str(workdir / "run"),
           "MODELWARDEN_DAEMON__ALLOW_OVERSUBSCRIPTION": "true",
           "MODELWARDEN_MODELS__minilm__WORKERS": str(workers),
           "MODELWARDEN_DAEMON__LOG_LEVEL": "WARNING"}
    env.pop("MODELWARDEN_CONFIG", None)
    log = open(workdir / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "modelwarden", "serve", "--config",
                               str(ROOT / "examples" / "minilm.toml")],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and daemon.poll() is None:
        try:
            status = control_request(f"ipc://{workdir}/run/control.sock", {"type": "status"}, 2.0)
            if status["status"]["models"][0]["ready"] == workers:
                return daemon, f"ipc://{workdir}/run/frontend.sock"
        except Exception:  # not listening yet
            pass
        time.sleep(0.5)  # a benchmark's wait, not a test's synchronisation
    daemon.kill()
    raise RuntimeError(f"the daemon did not serve minilm:\n{(workdir / 'daemon.log').read_text()[-3000:]}")


def in_process(model, inputs: list, batch: int, seconds: float) -> dict:
    """Sentences/s of the model here, ``batch`` sentences per forward, 1 thread."""
    ids = torch.cat([inputs[i % len(inputs)][0] for i in range(batch)])
    mask = torch.cat([inputs[i % len(inputs)][1] for i in range(batch)])
    timings = []
    deadline = time.perf_counter() + seconds
    with torch.inference_mode():
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            model(ids, mask)
            timings.append(time.perf_counter() - started)
    return {"rps": round(batch * len(timings) / sum(timings), 1),
            "p50_ms": round(statistics.median(timings) * 1000, 2)}


def point(endpoint: str, inputs: list, expected: torch.Tensor, concurrency: int,
          seconds: float) -> dict:
    from modelwarden import AsyncClient, Client

    def check(index: int, output) -> bool:
        return torch.allclose(output[0], expected[index], atol=1e-5)

    window = Window(min(2.0, seconds / 4), seconds)
    if concurrency == 1:
        with Client(endpoint) as client:
            return run_threads(lambda i: client.infer("minilm", inputs[i]), 1, window,
                               len(inputs), check)

    async def load() -> dict:
        async with AsyncClient(endpoint) as client:
            return await run_async(lambda i: client.infer("minilm", inputs[i]), concurrency,
                                   window, len(inputs), check)

    return asyncio.run(load())


def batch_counts(workdir: Path) -> tuple[int, float]:
    """(batches formed, requests in them) so far, from ``status``."""
    from modelwarden.client.control import control_request

    status = control_request(f"ipc://{workdir}/run/control.sock", {"type": "status"}, 5.0)["status"]
    batching = status["models"][0].get("batching") or {}
    batches = batching.get("batches", 0)
    return batches, batches * (batching.get("mean_size") or 0.0)


def main(argv: list[str] | None = None) -> int:
    from modelwarden.minilm import EXTRA_MISSING, Tokenizer, available, load_minilm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args(argv)
    if not available():
        print(EXTRA_MISSING, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    tokenizer = Tokenizer(args.length)
    inputs = [list(tokenizer([sentence])) for sentence in SENTENCES]
    model = load_minilm()
    with torch.inference_mode():
        expected = torch.cat([model(*pair) for pair in inputs])
    rows = [("in-process, 1 thread, batch 1", in_process(model, inputs, 1, args.seconds / 2)),
            ("in-process, 1 thread, batch 16", in_process(model, inputs, 16, args.seconds / 2))]
    workdir = Path(tempfile.mkdtemp(prefix="mw-minilm-", dir="/tmp"))
    daemon, endpoint = start_daemon(workdir, args.workers)
    try:
        rows.append((f"modelwarden, {args.workers} workers, 1 in flight",
                     point(endpoint, inputs, expected, 1, args.seconds)))
        before = batch_counts(workdir)
        rows.append((f"modelwarden, {args.workers} workers, 64 in flight, batching",
                     point(endpoint, inputs, expected, 64, args.seconds)))
        after = batch_counts(workdir)
        formed = after[0] - before[0]
        rows[-1][1]["mean_batch"] = round((after[1] - before[1]) / formed, 1) if formed else None
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"all-MiniLM-L6-v2, {args.length} tokens per sentence, {os.cpu_count()} CPUs")
    print(f"{'point':<48} {'sentences/s':>11} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'batch':>6}")
    failed = False
    for name, row in rows:
        errors = row.get("errors", 0)
        failed |= bool(errors)
        batch = row.get("mean_batch")
        print(f"{name:<48} {row['rps']:>11} {row['p50_ms'] or '-':>8} {row.get('p99_ms') or '-':>8} "
              f"{errors:>6} {batch if batch is not None else '-':>6}")
        if row.get("first_error"):
            print(f"  first error: {row['first_error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
