"""A load generator for tests: N client threads, every answer accounted for (``Counts``, shared
with the soak bench's ``run_counted`` in bench/loadgen.py).

The contract it checks is the daemon's: every request gets exactly one answer, a right result
or a typed error; ``sent == ok + errors`` always, and ``wrong == 0``.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from typing import Callable

import torch

from bench.loadgen import Counts
from modelwarden.client.client import Client, RemoteError


def run_load(endpoint: str, model: str, reference: Callable, clients: int = 4,
             requests: int = 100, features: int = 8, timeout: float = 60.0,
             make_input: Callable | None = None, stop: threading.Event | None = None) -> Counts:
    """Each of ``clients`` threads sends ``requests`` requests (or until ``stop`` is set)."""
    total = Counts()
    lock = threading.Lock()

    def one_client(seed: int) -> None:
        rng = random.Random(seed)
        counts = Counts()
        with Client(endpoint, timeout=timeout) as client:
            for _ in range(requests):
                if stop is not None and stop.is_set():
                    break
                x = make_input(rng) if make_input else torch.randn(rng.randint(2, 6), features)
                counts.sent += 1
                try:
                    y = client.infer(model, x)
                except RemoteError as exc:
                    counts.errors[exc.code] += 1
                    continue
                except Exception as exc:  # anything else breaks the contract
                    counts.unexpected.append(repr(exc))
                    continue
                counts.ok += 1
                expected = reference(x)
                if expected is not None and not torch.allclose(y, expected, rtol=1e-4, atol=1e-5):
                    counts.wrong += 1
        with lock:
            total.merge(counts)

    threads = [threading.Thread(target=one_client, args=(seed,)) for seed in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout * max(requests, 1) if stop is None else 600)
        if thread.is_alive():
            total.unexpected.append(f"{thread.name} still running: a client hangs")
    return total


class CapacitySampler:
    """Samples a model's READY worker count from the status socket until stopped; a sample that
    fails is a failure of the test, not a dip to ignore (replace before retire is only proven if
    every sample was taken).

        with CapacitySampler(daemon, "mlp") as capacity:
            ...             # replace workers
        assert capacity.minimum() >= 2
    """

    def __init__(self, daemon, model: str, every: float = 0.05) -> None:
        self.daemon = daemon
        self.model = model
        self.every = every
        self.samples: list[int] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                models = self.daemon.status(timeout=10)["models"]
                self.samples.append(next(m["ready"] for m in models if m["name"] == self.model))
            except Exception as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> "CapacitySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def minimum(self) -> int:
        assert not self.failures, f"capacity samples failed: {self.failures[:3]}"
        assert self.samples, "no capacity sample was taken"
        return min(self.samples)


def sigkill_storm(daemon, model: str, reference: Callable, kills: int = 12,
                  every: float = 0.3) -> tuple[Counts, list[int]]:
    """Load from 4 clients while a random READY worker of ``model`` is SIGKILLed every
    ``every`` seconds, ``kills`` times (the chaos cadence); the load runs until the last kill."""
    from tests.helpers import join_within

    stop, killed = threading.Event(), []

    def killer() -> None:
        rng = random.Random(0)
        try:
            while len(killed) < kills and not stop.wait(every):
                ready = [w["pid"] for w in daemon.workers(model, "READY")]
                if ready:
                    victim = rng.choice(ready)
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
        finally:
            stop.set()

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        counts = run_load(daemon.endpoint, model, reference, clients=4, requests=10**9, stop=stop)
    finally:
        stop.set()
        join_within(thread)
    return counts, killed
