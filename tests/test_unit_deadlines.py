"""supervisor/routing/deadlines.py with a fake clock and the loop's real Timers: one timer armed
for the earliest pending deadline, requests expired in deadline order, answered ones never, and
what the lanes hold bounded by what is pending."""

from __future__ import annotations

from modelwarden.supervisor.routing import deadlines
from modelwarden.supervisor.routing.deadlines import Deadlines
from modelwarden.supervisor.routing.requests import Request
from modelwarden.supervisor.timers import Timers


def pending_request(rid: int, deadline: float) -> Request:
    """A request as the router makes one; Deadlines reads its deadline and done."""
    return Request(rid, None, [], rid, "m", b"", [], 0, deadline)


class Rig:
    def __init__(self) -> None:
        self.now = 100.0
        self.timers = Timers()
        self.expired: list[int] = []
        self.deadlines = Deadlines(self.timers, lambda: self.now, self.expire)
        self.rids = iter(range(1, 1_000_000))

    def expire(self, request: Request) -> None:
        self.answer(request)
        self.expired.append(request.rid)

    def add(self, timeout: float) -> Request:
        request = pending_request(next(self.rids), self.now + timeout)
        request.timeout = timeout
        self.deadlines.add(request, timeout)
        return request

    def answer(self, request: Request) -> None:
        request.done = True
        self.deadlines.answered(request, request.timeout)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.timers.run_due(self.now)


def test_requests_expire_at_their_deadlines_in_order_across_timeouts():
    rig = Rig()
    slow, fast = rig.add(10), rig.add(2)
    rig.advance(1)
    later_fast = rig.add(2)  # due at 103, before slow (110)
    rig.advance(1.5)
    assert rig.expired == [fast.rid]
    rig.advance(1)
    assert rig.expired == [fast.rid, later_fast.rid]
    rig.advance(10)
    assert rig.expired == [fast.rid, later_fast.rid, slow.rid]
    assert len(rig.deadlines) == 0 and rig.deadlines.timer is None and len(rig.timers) == 0


def test_an_answered_request_never_expires_and_one_timer_serves_them_all():
    rig = Rig()
    requests = [rig.add(5) for _ in range(1000)]
    assert len(rig.timers) == 1  # not one per request
    for request in requests[:-1]:
        rig.answer(request)
    rig.advance(6)
    assert rig.expired == [requests[-1].rid]


def test_answered_requests_leave_the_lanes_as_they_are_answered():
    rig = Rig()
    requests = [rig.add(5) for _ in range(100)]
    for request in requests:
        rig.answer(request)
    assert rig.deadlines.held == 0 and not rig.deadlines.lanes


def test_what_the_lanes_hold_stays_bounded_when_answers_come_out_of_order():
    # A request that never finishes at the head of its lane: the thousands answered behind it
    # must not pile up until its deadline.
    rig = Rig()
    stuck = rig.add(30)
    for _ in range(20_000):
        rig.answer(rig.add(30))
        assert rig.deadlines.held <= 2 * len(rig.deadlines) + deadlines.COMPACT_ABOVE + 1
    rig.advance(31)
    assert rig.expired == [stuck.rid]


def test_timeouts_past_the_lane_limit_wait_in_the_heap_and_expire_in_order():
    rig = Rig()
    distinct = [rig.add(2 + index / 1000) for index in range(deadlines.MAX_LANES + 50)]
    assert len(rig.deadlines.lanes) == deadlines.MAX_LANES and len(rig.deadlines.overflow) == 50
    rig.advance(0.5)
    early = rig.add(0.6)  # earlier than every other: the timer is armed again for it
    rig.advance(0.7)
    assert rig.expired == [early.rid]
    rig.advance(2)
    assert rig.expired == [early.rid] + [request.rid for request in distinct]


def test_a_deadline_earlier_than_the_armed_timer_rearms_it():
    rig = Rig()
    rig.add(100)
    short = rig.add(1)
    assert rig.deadlines.armed_for == short.deadline
    rig.advance(1)
    assert rig.expired == [short.rid]
