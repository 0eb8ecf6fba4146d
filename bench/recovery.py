"""What a crash costs: SIGKILL a READY worker under load, with and without a warm standby.

    python bench/recovery.py [--seconds 5] [--clients 4] [--load-seconds 1.0] [--json FILE]

For ``standby = 0`` and then ``standby = 1`` (one run, one table): start a daemon serving
``bench.models:make_slow_loading`` (the W1 MLP behind a ~1 s load, 20 warm-up passes, 2 workers of
1 core and 1 thread each), wait until its workers have been up longer than ``start_seconds`` (so
the kill is a crash after a good start, not a failed start), run ``--clients`` closed-loop
clients, SIGKILL the READY worker of slot 0 in the middle and measure:

  kill->READY   from the kill to slot 0's next worker READY (status polled every 2 ms)
  rps before    requests answered in the ``--seconds`` before the kill, per second
  rps after     the same in the ``--seconds`` after it; ``ratio`` = after / before
  p99 before / after   request latency in those windows
  lost          requests sent but not answered ok (a typed error counts, nothing may be missing)

Targets (issue 14): with a standby, kill->READY <= 100 ms and ratio >= 0.9; without one,
the slot is empty for the whole boot. The JSON (``--json``) has the machine, the settings and one
object per configuration, with its timeline: answers per 0.1 s and p99 per 0.5 s around the kill.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modelwarden.client.client import Client, RemoteError, control_request  # noqa: E402

MODEL = "slow"
START_SECONDS = 2.0

CONFIG = """\
[daemon]
runtime_dir = "{runtime}"
python_path = ["{root}"]
heartbeat_interval = 0.2

[[models]]
name = "{model}"
source = "python:bench.models:make_slow_loading"
kwargs = {{ load_seconds = {load_seconds} }}
workers = 2
standby = {standby}
cores_per_worker = 1
threads = 1
warmup = 20
start_seconds = {start_seconds}
inputs = [{{ name = "x", dtype = "float32", shape = [-1, 64] }}]
[models.probe]
interval = 0.0
"""


def status(workdir: Path) -> dict:
    return control_request(f"ipc://{workdir}/run/control.sock", {"type": "status"}, 5.0)["status"]


def start(workdir: Path, standby: int, load_seconds: float) -> subprocess.Popen:
    config = workdir / "recovery.toml"
    config.write_text(CONFIG.format(runtime=workdir / "run", root=ROOT, model=MODEL,
                                    standby=standby, load_seconds=load_seconds,
                                    start_seconds=START_SECONDS))
    return subprocess.Popen([sys.executable, "-m", "modelwarden", "serve", "--config", str(config)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(workdir / "log", "wb"))


def wait_settled(daemon: subprocess.Popen, workdir: Path, standby: int, timeout: float = 180):
    """Every slot READY for longer than start_seconds, and the standbys warm."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited: see {workdir / 'log'}")
        try:
            workers = status(workdir)["workers"]
        except Exception:
            time.sleep(0.2)
            continue
        slots = [w for w in workers if not w.get("standby")]
        warm = [w for w in workers if w["state"] == "STANDBY"]
        if (all(w["state"] == "READY" and (w["ready_s"] or 0) > START_SECONDS + 0.5 for w in slots)
                and len(warm) >= standby):
            return slots
        time.sleep(0.2)
    raise RuntimeError("the daemon did not settle")


class Load:
    """Closed-loop clients; every answer recorded as (finish time, latency, ok)."""

    def __init__(self, endpoint: str, clients: int) -> None:
        self.endpoint = endpoint
        self.stop = threading.Event()
        self.records: list[tuple[float, float, bool]] = []
        self.sent = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(n,)) for n in range(clients)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _client(self, seed: int) -> None:
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed))
        records = []
        sent = 0
        with Client(self.endpoint, timeout=60) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                sent += 1
                try:
                    client.infer(MODEL, x)
                    ok = True
                except RemoteError:
                    ok = False
                records.append((time.monotonic(), time.monotonic() - started, ok))
        with self.lock:
            self.records.extend(records)
            self.sent += sent


def window(records, start: float, end: float) -> dict:
    latencies = sorted(lat for at, lat, ok in records if start <= at < end and ok)
    n = len(latencies)
    return {"rps": round(n / (end - start), 1),
            "p99_ms": round(latencies[min(n - 1, int(n * 0.99))] * 1000, 2) if n else None}


def timeline(records, killed_at: float, seconds: float, bin_s: float = 0.1,
             p99_bin_s: float = 0.5) -> dict:
    """Answers per second in ``bin_s`` bins and p99 latency in ``p99_bin_s`` bins, from
    ``seconds`` before the kill to ``seconds`` after it (times relative to the kill)."""
    def binned(width: float) -> list[list[float]]:
        bins: list[list[float]] = [[] for _ in range(round(2 * seconds / width))]
        for at, latency, ok in records:
            index = int((at - killed_at + seconds) // width)
            if ok and 0 <= index < len(bins):
                bins[index].append(latency)
        return bins

    p99 = [sorted(b)[min(len(b) - 1, int(len(b) * 0.99))] * 1000 if b else None
           for b in binned(p99_bin_s)]
    return {"start_s": -seconds, "bin_s": bin_s, "rps": [round(len(b) / bin_s, 1) for b in binned(bin_s)],
            "p99_bin_s": p99_bin_s, "p99_ms": [None if v is None else round(v, 2) for v in p99]}


def time_to_ready(workdir: Path, victim: int, killed_at: float, limit: float = 60) -> float:
    while time.monotonic() - killed_at < limit:
        row = next(w for w in status(workdir)["workers"] if w["id"] == f"{MODEL}#0")
        if row["state"] == "READY" and row["pid"] != victim:
            return time.monotonic() - killed_at
        time.sleep(0.002)
    raise RuntimeError("slot 0 not READY again")


def run(standby: int, seconds: float, clients: int, load_seconds: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="mw-rec-", dir="/tmp"))
    daemon = start(workdir, standby, load_seconds)
    try:
        slots = wait_settled(daemon, workdir, standby)
        victim = next(w["pid"] for w in slots if w["id"] == f"{MODEL}#0")
        endpoint = f"ipc://{workdir}/run/frontend.sock"
        with Load(endpoint, clients) as load:
            time.sleep(1.0 + seconds)  # 1 s to get going, then the "before" window
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            ready_s = time_to_ready(workdir, victim, killed_at)
            time.sleep(max(0.0, killed_at + seconds - time.monotonic()))
        before = window(load.records, killed_at - seconds, killed_at)
        after = window(load.records, killed_at, killed_at + seconds)
        ok = sum(1 for _, _, good in load.records if good)
        promoted = "promoting standby" in (workdir / "log").read_text()
        return {"standby": standby, "kill_to_ready_ms": round(ready_s * 1000, 1),
                "rps_before": before["rps"], "rps_after": after["rps"],
                "ratio": round(after["rps"] / before["rps"], 3) if before["rps"] else None,
                "p99_before_ms": before["p99_ms"], "p99_after_ms": after["p99_ms"],
                "sent": load.sent, "ok": ok, "lost": load.sent - len(load.records),
                "errors": len(load.records) - ok, "promoted": promoted,
                "timeline": timeline(load.records, killed_at, seconds)}
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def table(rows: list[dict]) -> str:
    header = ("standby", "kill->READY", "rps before", "rps after", "ratio", "p99 before",
              "p99 after", "sent", "errors", "lost")
    lines = [header]
    for r in rows:
        lines.append((str(r["standby"]), f"{r['kill_to_ready_ms']:.0f} ms", f"{r['rps_before']:.0f}",
                      f"{r['rps_after']:.0f}", f"{r['ratio']:.2f}", f"{r['p99_before_ms']} ms",
                      f"{r['p99_after_ms']} ms", str(r["sent"]), str(r["errors"]), str(r["lost"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths))
                     for line in lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--load-seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from bench.machine import command, machine

    measured_on = machine()
    rows = [run(standby, args.seconds, args.clients, args.load_seconds) for standby in (0, 1)]
    print(table(rows))
    if args.json:
        settings = {"seconds": args.seconds, "clients": args.clients,
                    "load_seconds": args.load_seconds, "workers": 2, "threads": 1}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": measured_on, "command": command(),
                                         "settings": settings, "runs": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
