"""Soak: many minutes of load while workers are SIGKILLed, and every answer accounted for.

    python bench/soak.py [--minutes 10] [--kill-every 0.3] [--clients 4] [--workers 2]

Starts a real daemon (the test model of tests/faulty.py, healthy), runs ``--clients`` client
threads for ``--minutes`` while a killer SIGKILLs a random READY worker every ``--kill-every``
seconds, then prints and writes (bench/results/soak.json) the counts. The contract: every request
sent is answered (sent == ok + typed errors), none is answered wrongly, no shared memory leaks,
and the only failures are POISON: a request that was in flight on two workers that both died (the
retry rule: re-sent once; a second death means poison, never retried again). Each POISON needs
two kills landing on the same request, so there are at most kills / 2 of them; at a kill every
0.3 s they are rare. Exits 1 if the contract is broken.
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

from tests.faulty import reference  # noqa: E402
from tests.helpers import Daemon, faulty_model, memfd_holders  # noqa: E402
from tests.load import run_load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=0.3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = parser.parse_args()

    model = faulty_model("soak", workers=args.workers, start_seconds=0.5, timeout=120.0,
                         heartbeat_timeout=5.0, backoff_initial=0.1, max_start_failures=50)
    with Daemon([model], daemon={"shm_threshold": 4096}) as daemon:
        daemon.wait_ready()
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
        # half the clients send small (inline) requests, half big ones (shared memory)
        import torch

        counts = run_load(daemon.endpoint, "soak", reference, clients=args.clients,
                          requests=10**9, stop=stop, timeout=120.0,
                          make_input=lambda rng: torch.randn(rng.choice([3, 3000]), 8))
        elapsed = time.monotonic() - started
        stop.set()
        for thread in threads:
            thread.join()
        status = daemon.status()
    leaked = memfd_holders(exclude=(os.getpid(),))  # pid -> buffer descriptors still held
    report = {"minutes": round(elapsed / 60, 2), "kills": len(kills), "sent": counts.sent,
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
