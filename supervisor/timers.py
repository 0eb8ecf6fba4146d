"""Deadlines for the poll loop: one heap, monotonic time, cancellation by flag.

The loop asks ``next_due()`` for its poll timeout and calls ``run_due(now)`` after each poll.
``now`` is always passed in, so tests drive the timers with a fake clock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Timer:
    __slots__ = ("when", "callback", "args", "cancelled")

    def __init__(self, when: float, callback: Callable, args: tuple) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False  # set only through Timers.cancel, which keeps the count


class Timers:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()
        self._cancelled = 0

    def call_at(self, when: float, callback: Callable, *args: Any) -> Timer:
        timer = Timer(when, callback, args)
        heapq.heappush(self._heap, (when, next(self._order), timer))
        return timer

    def cancel(self, timer: Timer | None) -> None:
        if timer is None or timer.cancelled:
            return
        timer.cancelled = True
        timer.args = ()  # a cancelled entry waits in the heap: it must not keep a request's payload alive
        self._cancelled += 1
        # Cancelled entries wait for their time to pop; rebuild when they are most of the heap
        # (requests that finish long before their deadline would otherwise pile up).
        if self._cancelled > 1024 and self._cancelled * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].cancelled]
            heapq.heapify(self._heap)
            self._cancelled = 0

    def next_due(self) -> float | None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
            self._cancelled -= 1
        return self._heap[0][0] if self._heap else None

    def run_due(self, now: float) -> int:
        """Fire every timer due at ``now``, in deadline order; returns how many fired."""
        fired = 0
        while self._heap and self._heap[0][0] <= now:
            _, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                self._cancelled -= 1
                continue
            timer.cancelled = True  # fired: a later cancel() is a no-op and is not counted
            try:
                timer.callback(*timer.args)
            except Exception:  # one failing timer must not stop the others, nor the loop
                logger.exception("timer %s failed", getattr(timer.callback, "__name__", "?"))
            fired += 1
        return fired

    def __len__(self) -> int:
        return len(self._heap) - self._cancelled
