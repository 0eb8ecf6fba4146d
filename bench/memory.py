"""What N workers of one big model cost in memory, with and without ``weights = "mmap"``.

    python bench/memory.py [--workers 4] [--width 7168] [--json FILE]

Writes an MLP of ``width x width`` (+ a small head) as a .safetensors file (205 MB at the default
width) and starts the daemon three times, each time ``--workers`` workers (1 thread each):
  runtime   the tiny example MLP: what a worker costs with no weights to speak of (torch, the
            interpreter, the serving loop) -- the per-worker runtime overhead
  load      the big model, ``weights = "load"``: every worker reads its own copy
  mmap      the big model, ``weights = "mmap"``: the workers map the file copy-on-write
For each it sums the workers' PSS (``/proc/<pid>/smaps_rollup``: shared pages divided among the
processes sharing them, so the sum counts each page once) once all are READY and warmed up (every
weight touched). Target for mmap: total PSS <= workers x the runtime overhead + 1.2 x the weights.
Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = """\
[daemon]
runtime_dir = "{runtime}"
allow_oversubscription = true
log_level = "WARNING"

[[models]]
name = "m"
source = "python:modelwarden.examples:make_mlp"
kwargs = {kwargs}
workers = {workers}
threads = 1
warmup = 2
inputs = [{{ name = "x", dtype = "float32", shape = [-1, {width}] }}]
{weights}
[models.probe]
interval = 0.0
"""


def write_weights(path: Path, width: int) -> int:
    from modelwarden.examples import make_mlp
    from modelwarden.worker.weights import save_safetensors

    save_safetensors(make_mlp(width, width, 10, seed=1).state_dict(), path)
    return path.stat().st_size


def pss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss line for pid {pid}")


def measure(workdir: Path, name: str, workers: int, width: int, weights: str) -> list[int]:
    """The PSS of each worker of one daemon run, once every worker is READY."""
    from modelwarden.client.control import control_request

    run = workdir / name
    run.mkdir()
    if weights == "none":
        kwargs, extra, in_width = "{ }", "", 64
    else:
        kwargs = f"{{ in_features = {width}, hidden = {width}, empty = true }}"
        extra = f'weights = "{weights}"\nweights_file = "{workdir / "big.safetensors"}"\n'
        in_width = width
    config = run / "bench.toml"
    config.write_text(CONFIG.format(runtime=run / "run", kwargs=kwargs, workers=workers,
                                    width=in_width, weights=extra))
    log = open(run / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "modelwarden", "serve", "--config", str(config)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        pids = wait_ready(daemon, f"ipc://{run}/run/control.sock", workers, control_request)
        return [pss_bytes(pid) for pid in pids]
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()


def wait_ready(daemon, control: str, workers: int, control_request, timeout: float = 300.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with {daemon.returncode}")
        try:
            status = control_request(control, {"type": "status"}, 2.0)["status"]
            ready = [w["pid"] for w in status["workers"] if w["state"] == "READY"]
            if len(ready) == workers:
                return ready
        except Exception:  # not listening yet
            pass
        time.sleep(0.5)  # a benchmark's wait, not a test's synchronisation
    raise RuntimeError("the workers did not become READY")


def report(results: dict[str, list[int]], weights_bytes: int, workers: int) -> bool:
    mb = 1 / 1e6
    overhead = sum(results["runtime"]) / workers
    target = workers * overhead + 1.2 * weights_bytes
    print(f"weights file: {weights_bytes * mb:.0f} MB; per-worker runtime overhead (PSS): "
          f"{overhead * mb:.0f} MB; target for mmap: {workers} x {overhead * mb:.0f} + 1.2 x "
          f"{weights_bytes * mb:.0f} = {target * mb:.0f} MB")
    print(f"{'run':<8} {'workers':>7} {'total PSS MB':>13} {'per worker MB':>14} {'vs target':>10}")
    for name, values in results.items():
        total = sum(values)
        print(f"{name:<8} {workers:>7} {total * mb:>13.0f} {total / workers * mb:>14.0f} "
              f"{total / target:>9.2f}x")
    passed = sum(results["mmap"]) <= target
    print(f"mmap target (total PSS <= {target * mb:.0f} MB): {'PASS' if passed else 'FAIL'}")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--width", type=int, default=7168, help="7168: 205 MB of float32 weights")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args(argv)
    from bench.machine import command, machine

    measured_on = machine()
    workdir = Path(tempfile.mkdtemp(prefix="mw-mem-", dir="/tmp"))
    try:
        weights_bytes = write_weights(workdir / "big.safetensors", args.width)
        results = {name: measure(workdir, name, args.workers, args.width, weights)
                   for name, weights in (("runtime", "none"), ("load", "load"), ("mmap", "mmap"))}
        passed = report(results, weights_bytes, args.workers)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "machine": measured_on, "command": command(), "workers": args.workers,
                "width": args.width, "weights_bytes": weights_bytes, "pss_bytes": results,
                "target_bytes": round(sum(results["runtime"]) + 1.2 * weights_bytes),
                "met": passed}, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0 if passed else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
