"""Soak: many minutes of load while workers are SIGKILLed, and every answer accounted for.

    python bench/soak.py [--minutes 10] [--kill-every 0.3] [--clients 4] [--workers 2]

Starts a real daemon (modelwarden.testing) serving the test model of tests/faulty.py, healthy:
its workers import it by its module path (the repository root is on the daemon's python_path);
this script never does. It first asks the calm daemon for the answers to a fixed set of inputs
(the golden answers), then runs ``--clients`` client threads (bench/loadgen.py) sending those
inputs for ``--minutes`` while a killer SIGKILLs a random READY worker every ``--kill-every``
seconds, and prints and writes (bench/results/soak.json) the counts. The contract: every request
sent is answered (sent == ok + typed errors), none is answered otherwise than the calm daemon
answered it, no shared memory leaks, and the only failures are POISON: a request that was in
flight on two workers that both died (the retry rule: re-sent once; a second death means poison,
never retried again). Each POISON needs two kills landing on the same request, so there are at
most kills / 2 of them; at a kill every 0.3 s they are rare. Exits 1 if the contract is broken.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import run_counted  # noqa: E402
from modelwarden.testing import LocalDaemon, memfd_holders  # noqa: E402

FEATURES = 8  # tests/faulty.py's model: y = x @ W + 1 over [N, 8]
# Half the inputs small (inline in the message), half big (over shm_threshold: shared memory).
ROWS = (3, 3000)
INPUTS_PER_SIZE = 8


def soak_config(workers: int) -> dict:
    """The daemon's configuration: the faulty model with no fault, restarted fast and often."""
    model = {"name": "soak", "source": "python:tests.faulty:make_faulty", "kwargs": {"fault": "none"},
             "workers": workers, "cores_per_worker": 1, "threads": 1, "warmup": 2,
             "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, FEATURES]}],
             "start_seconds": 0.5, "timeout": 120.0, "heartbeat_timeout": 5.0,
             "backoff_initial": 0.1, "max_start_failures": 50}
    daemon = {"allow_oversubscription": True, "heartbeat_interval": 0.2,
              "python_path": [str(ROOT)], "shm_threshold": 4096}
    return {"daemon": daemon, "models": [model]}


def golden_answers(endpoint: str) -> list[tuple]:
    """(input, the calm daemon's answer) pairs, before any kill."""
    import torch

    from modelwarden import Client

    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randn(rows, FEATURES, generator=generator)
              for rows in ROWS for _ in range(INPUTS_PER_SIZE)]
    with Client(endpoint, timeout=120.0) as client:
        return [(x, client.infer("soak", x)) for x in inputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=0.3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = parser.parse_args()

    import torch

    from modelwarden import Client, RemoteError

    with LocalDaemon(soak_config(args.workers), cwd=ROOT) as daemon:
        daemon.wait_ready()
        golden = golden_answers(daemon.endpoint)

        def answered_right(client, rng: random.Random) -> bool:
            x, expected = rng.choice(golden)
            return torch.allclose(client.infer("soak", x), expected, rtol=1e-4, atol=1e-5)

        stop, kills = threading.Event(), []

        def killer() -> None:
            rng = random.Random(1)
            while not stop.wait(args.kill_every):  # the chaos cadence
                try:
                    ready = [w["pid"] for w in daemon.workers("soak", "READY")]
                except Exception:  # a slow status answer under load: skip this beat
                    continue
                if ready:
                    victim = rng.choice(ready)
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)

        def timer() -> None:
            stop.wait(args.minutes * 60)
            stop.set()

        threads = [threading.Thread(target=killer), threading.Thread(target=timer)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        counts = run_counted(lambda: Client(daemon.endpoint, timeout=120.0), answered_right,
                             lambda exc: exc.code if isinstance(exc, RemoteError) else None,
                             args.clients, stop)
        elapsed = time.monotonic() - started
        stop.set()
        for thread in threads:
            thread.join()
        status = daemon.status()
    leaked = memfd_holders(exclude=(os.getpid(),))  # pid -> buffer descriptors still held
    from bench.machine import command, machine

    report = {"machine": machine(at="end"), "command": command(), "kill_every_s": args.kill_every,
              "clients": args.clients, "workers": args.workers, "minutes": round(elapsed / 60, 2), "kills": len(kills), "sent": counts.sent,
              "ok": counts.ok, "wrong": counts.wrong, "errors": dict(counts.errors),
              "unexpected": counts.unexpected[:10], "leaked_buffer_holders": len(leaked),
              "restarts": sum(w["restarts"] for w in status["workers"])}
    print(json.dumps(report, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    only_poison = set(counts.errors) <= {"POISON"} and 2 * counts.errors["POISON"] <= len(kills)
    kept = counts.reconciles() and counts.wrong == 0 and only_poison and not leaked
    print("contract kept" if kept else "CONTRACT BROKEN")
    return 0 if kept else 1


if __name__ == "__main__":
    sys.exit(main())
