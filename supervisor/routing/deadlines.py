"""Request deadlines: one FIFO lane per timeout, and one timer for the earliest of them all.

Every request gets a deadline (``arrived + timeout``) and most finish long before it. A timer and
a heap entry per request, made and cancelled on every request's path, cost more than the rest of
its accounting together; here a request costs one append when it is accepted. Requests with the
same timeout arrive in deadline order (the clock is monotonic), so each timeout's lane is a
deque whose head is its earliest deadline: the earliest of all is the earliest head. One timer in
the loop's Timers is armed for it; when it fires, what is due is expired and it is armed again
for the new earliest head. It fires about once per timeout period under steady traffic, since the
requests at the heads have mostly been answered by then.

Answered requests leave their lane lazily: the heads are trimmed as they are answered (answers
come roughly in arrival order), and when answered ones are most of what the lanes hold, every
lane is rebuilt without them, so what lanes hold stays within twice what is pending (plus a
constant), however the answers are ordered. A timeout no lane has gets a new lane, at most
MAX_LANES of them (a client names its own ``timeout_ms``); past that, requests wait in a heap
ordered by deadline, which the same timer serves.
"""

from __future__ import annotations

import collections
import heapq

MAX_LANES = 64  # distinct timeouts with a lane of their own at one time
COMPACT_ABOVE = 1024  # answered requests the lanes may hold before a rebuild is considered


class Deadlines:
    """The deadlines of pending requests (supervisor/routing/requests.py: ``deadline``, ``done``).
    ``timers`` and ``clock`` are the loop's (supervisor/timers.py); ``expire(request)`` answers
    one whose deadline passed: it is called only for requests not yet done, in deadline order."""

    def __init__(self, timers, clock, expire):
        self.timers = timers
        self.clock = clock
        self.expire = expire
        self.lanes = {}  # timeout (seconds) -> deque of requests, deadlines non-decreasing
        self.overflow = []  # (deadline, rid, request), a heap: timeouts without a lane
        self.live = 0  # pending requests held here
        self.held = 0  # requests held here, answered or not
        self.timer = None
        self.armed_for = 0.0  # the deadline ``timer`` fires at (while it is set)

    def add(self, request, timeout):
        """Hold ``request`` (its ``deadline`` is ``now + timeout``) until it is answered."""
        lane = self.lanes.get(timeout)
        if lane is None:
            if len(self.lanes) < MAX_LANES:
                lane = self.lanes[timeout] = collections.deque()
            else:
                heapq.heappush(self.overflow, (request.deadline, request.rid, request))
        if lane is not None:
            lane.append(request)
        self.live += 1
        self.held += 1
        if self.timer is None or request.deadline < self.armed_for:
            self._arm(request.deadline)

    def answered(self, request, timeout):
        """``request`` (added with ``timeout``) is done: it leaves its lane when it reaches the
        head, or at the next rebuild."""
        self.live -= 1
        lane = self.lanes.get(timeout)
        if lane is not None:
            while lane:
                head = lane[0]
                if not head.done:
                    break
                lane.popleft()
                self.held -= 1
            if not lane:
                del self.lanes[timeout]
        if self.held - self.live > COMPACT_ABOVE and self.held > 2 * self.live:
            self._compact()

    def __len__(self):
        return self.live

    def next_due(self):
        """The earliest deadline of a pending request, or None."""
        earliest = None
        for timeout in list(self.lanes):
            lane = self.lanes[timeout]
            while lane and lane[0].done:
                lane.popleft()
                self.held -= 1
            if not lane:
                del self.lanes[timeout]
            elif earliest is None or lane[0].deadline < earliest:
                earliest = lane[0].deadline
        overflow = self.overflow
        while overflow and overflow[0][2].done:
            heapq.heappop(overflow)
            self.held -= 1
        if overflow and (earliest is None or overflow[0][0] < earliest):
            earliest = overflow[0][0]
        return earliest

    def _arm(self, when):
        if self.timer is not None:
            self.timers.cancel(self.timer)
        self.timer = self.timers.call_at(when, self._fire)
        self.armed_for = when

    def _fire(self):
        self.timer = None
        for request in self._due(self.clock()):
            if not request.done:
                self.expire(request)
        due = self.next_due()
        if due is not None and self.timer is None:
            self._arm(due)

    def _due(self, now):
        """Every pending request whose deadline is at or before ``now``, earliest first, out of
        the lanes."""
        due = []
        for timeout in list(self.lanes):
            lane = self.lanes[timeout]
            while lane and (lane[0].done or lane[0].deadline <= now):
                request = lane.popleft()
                self.held -= 1
                if not request.done:
                    due.append(request)
            if not lane:
                del self.lanes[timeout]
        overflow = self.overflow
        while overflow and (overflow[0][2].done or overflow[0][0] <= now):
            request = heapq.heappop(overflow)[2]
            self.held -= 1
            if not request.done:
                due.append(request)
        due.sort(key=_deadline_of)
        return due

    def _compact(self):
        for timeout in list(self.lanes):
            kept = collections.deque(request for request in self.lanes[timeout] if not request.done)
            if kept:
                self.lanes[timeout] = kept
            else:
                del self.lanes[timeout]
        self.overflow = [entry for entry in self.overflow if not entry[2].done]
        heapq.heapify(self.overflow)
        self.held = sum(map(len, self.lanes.values())) + len(self.overflow)


def _deadline_of(request):
    return request.deadline
