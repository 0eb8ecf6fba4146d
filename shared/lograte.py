"""Log lines that someone outside can cause, at most one per source per interval, with a count.

A peer that keeps failing (a CURVE handshake with a fresh key each time, a client passing
buffers a worker cannot map) must not be able to fill the log: the first failure from a source
is reported, the next ones within ``interval`` are only counted, and the first one after it is
reported with how many there were since the last line. The source is who causes it (an address,
a uid), never what changes with each attempt (a key, a token), or fresh keys would each get a
line. Time is passed in (``now``), so the rule is tested with a fake clock.
"""

from __future__ import annotations

REMEMBERED_SOURCES = 4096  # beyond this, sources not reported within an interval are forgotten


class LineBudget:
    """When each source was last reported, and how many failures it has had since."""

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}  # source -> (last line's time, held back)

    def due(self, source: str, now: float) -> int:
        """Count one failure from ``source``: the number to report now (this one and those held
        back since the last line), or 0 when its line is not due yet."""
        last = self._last.get(source)
        if last is not None and now - last[0] < self.interval:
            self._last[source] = (last[0], last[1] + 1)
            return 0
        if len(self._last) >= REMEMBERED_SOURCES:  # a scan of addresses: keep the recent ones
            self._last = {s: v for s, v in self._last.items() if now - v[0] < self.interval}
        self._last[source] = (now, 0)
        return 1 + (last[1] if last is not None else 0)

    def __len__(self) -> int:
        return len(self._last)
