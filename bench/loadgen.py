"""Closed-loop load for bench/serving.py: N callers, each sends its next request as soon as its
last one is answered, for a warm-up and then a fixed measuring window; and counted load for
bench/soak.py (``run_counted``): every answer of every request accounted for, no latencies.

Standard library only: the peers' HTTP load generator (bench/peers/httpload.py) runs it in the
peer's own virtualenv. A request counts in the window when it *ends* inside it; its latency is
its own round trip (requests still in flight DRAIN_S after the window are cancelled).
``check(index, output)`` runs on every CHECK_EVERY-th answer of a caller and on its first in
the window; a False (or an exception) counts as a mismatch, and mismatches are errors.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ContextManager

CHECK_EVERY = 25
DRAIN_S = 2.0  # how long the async callers may finish their last requests after the window


class Window:
    """What one point measured: latencies (ns) and counts of the requests ending in the window."""

    def __init__(self, warmup_s: float, duration_s: float,
                 probe: Callable[[], Any] | None = None) -> None:
        self.start = time.perf_counter_ns() + int(warmup_s * 1e9)
        self.end = self.start + int(duration_s * 1e9)
        self.duration_s = duration_s
        self.probe = probe
        self.probes: list[Any] = []
        self.latencies: list[int] = []
        self.errors = 0
        self.mismatches = 0
        self.checked = 0
        self.first_error = ""
        self._lock = threading.Lock()

    def open(self) -> bool:
        return time.perf_counter_ns() < self.end

    def record(self, started: int, ended: int, error: str | None, mismatch: bool = False,
               checked: bool = False) -> None:
        if not self.start <= ended < self.end:
            return
        with self._lock:
            if error is not None:
                self.errors += 1
                self.first_error = self.first_error or error
            elif mismatch:
                self.mismatches += 1
                self.first_error = self.first_error or "output differs from the in-process model"
            else:
                self.latencies.append(ended - started)
            self.checked += checked

    def take_probe(self) -> None:
        if self.probe is not None:
            self.probes.append(self.probe())

    def summary(self) -> dict:
        samples = sorted(self.latencies)
        ok = len(samples)

        def quantile(q: float) -> float | None:
            return round(samples[min(ok - 1, int(ok * q))] / 1e6, 3) if ok else None

        return {"ok": ok, "errors": self.errors + self.mismatches, "mismatches": self.mismatches,
                "checked": self.checked, "rps": round(ok / self.duration_s, 1),
                "p50_ms": quantile(0.50), "p99_ms": quantile(0.99),
                "first_error": self.first_error or None}


def _checked(window: Window, count: int, check, index: int, output: Any, ended: int,
             seen: list) -> tuple[bool, bool]:
    """(mismatch, checked) for the count-th answer of a caller: every CHECK_EVERY-th, and its
    first inside the window (``seen`` remembers it), so a slow point is checked too."""
    first = not seen and window.start <= ended < window.end
    if check is None or (count % CHECK_EVERY and not first):
        return False, False
    if first:
        seen.append(True)
    try:
        return not check(index, output), True
    except Exception:
        return True, True


def run_threads(call: Callable[[int], Any], concurrency: int, window: Window,
                inputs: int, check=None) -> dict:
    """``concurrency`` threads, each calling ``call(index)`` in a closed loop."""

    def caller(offset: int) -> None:
        count, seen = 0, []
        while window.open():
            index = (offset + count) % inputs
            started = time.perf_counter_ns()
            error = output = None
            try:
                output = call(index)
            except Exception as exc:  # every failure is counted, never raised
                error = f"{type(exc).__name__}: {exc}"
            ended = time.perf_counter_ns()
            mismatch, checked = (False, False) if error else _checked(window, count, check, index, output, ended, seen)
            window.record(started, ended, error, mismatch, checked)
            output = None  # drop it now: a shared-memory output frees its buffer
            count += 1

    threads = [threading.Thread(target=caller, args=(n,), daemon=True) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    _sleep_until(window.start)
    window.take_probe()
    _sleep_until(window.end)
    window.take_probe()
    for thread in threads:
        thread.join()
    return window.summary()


async def run_async(call: Callable[[int], Awaitable[Any]], concurrency: int, window: Window,
                    inputs: int, check=None) -> dict:
    """``concurrency`` tasks on the running loop, each awaiting ``call(index)`` in a closed loop."""

    async def caller(offset: int) -> None:
        count, seen = 0, []
        while window.open():
            index = (offset + count) % inputs
            started = time.perf_counter_ns()
            error = output = None
            try:
                output = await call(index)
            except Exception as exc:  # every failure is counted, never raised
                error = f"{type(exc).__name__}: {exc}"
            ended = time.perf_counter_ns()
            mismatch, checked = (False, False) if error else _checked(window, count, check, index, output, ended, seen)
            window.record(started, ended, error, mismatch, checked)
            output = None
            count += 1

    async def prober() -> None:
        await asyncio.sleep(max(0.0, (window.start - time.perf_counter_ns()) / 1e9))
        window.take_probe()
        await asyncio.sleep(max(0.0, (window.end - time.perf_counter_ns()) / 1e9))
        window.take_probe()

    callers = [asyncio.ensure_future(caller(n)) for n in range(concurrency)]
    await prober()
    # Requests still in flight after the window count for nothing: a slow server's backlog
    # (64 x its latency) must not hold the next point up. Abandoned, they are cancelled.
    _, late = await asyncio.wait(callers, timeout=DRAIN_S)
    for task in late:
        task.cancel()
    await asyncio.gather(*callers, return_exceptions=True)
    return window.summary()


def _sleep_until(deadline_ns: int) -> None:
    remaining = (deadline_ns - time.perf_counter_ns()) / 1e9
    if remaining > 0:
        time.sleep(remaining)


# -- counted load: every answer accounted for ------------------------------------------------


@dataclass
class Counts:
    """What counted load saw. The daemon's contract: ``sent == ok + failed`` with nothing
    unexpected (every request gets exactly one answer, a result or a typed error), and
    ``wrong == 0``."""

    sent: int = 0
    ok: int = 0
    wrong: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)  # typed error code -> n
    unexpected: list = field(default_factory=list)  # failures that are no typed error

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def reconciles(self) -> bool:
        return self.sent == self.ok + self.failed and not self.unexpected

    def merge(self, other: "Counts") -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.wrong += other.wrong
        self.errors.update(other.errors)
        self.unexpected.extend(other.unexpected)

    def __str__(self) -> str:
        return (f"sent={self.sent} ok={self.ok} wrong={self.wrong} errors={dict(self.errors)} "
                f"unexpected={self.unexpected[:3]}")


def run_counted(connect: Callable[[], ContextManager[Any]], request: Callable[[Any, random.Random], bool],
                error_code: Callable[[Exception], str | None], clients: int,
                stop: threading.Event, join_timeout: float = 600.0) -> Counts:
    """``clients`` threads, each with its own connection (``with connect() as client``), sending
    ``request(client, rng)`` until ``stop`` is set. ``request`` returns whether the answer was
    right; an exception is a typed error when ``error_code`` names its code, else unexpected.
    A thread still running ``join_timeout`` seconds after ``stop`` is a hung client: unexpected."""
    total, lock = Counts(), threading.Lock()

    def one_client(seed: int) -> None:
        rng, counts = random.Random(seed), Counts()
        try:
            with connect() as client:
                while not stop.is_set():
                    counts.sent += 1
                    try:
                        right = request(client, rng)
                    except Exception as exc:  # counted, never raised: the contract is the count
                        code = error_code(exc)
                        if code is None:
                            counts.unexpected.append(repr(exc))
                        else:
                            counts.errors[code] += 1
                        continue
                    counts.ok += 1
                    counts.wrong += not right
        except Exception as exc:  # the connection itself failed: no count can be trusted
            counts.unexpected.append(f"client {seed}: {exc!r}")
        finally:
            with lock:
                total.merge(counts)

    threads = [threading.Thread(target=one_client, args=(seed,), name=f"client-{seed}")
               for seed in range(clients)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(join_timeout)
        if thread.is_alive():
            total.unexpected.append(f"{thread.name} still running: a client hangs")
    return total
