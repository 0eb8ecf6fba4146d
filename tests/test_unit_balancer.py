"""The multi-endpoint policy (client/balancer.py) with a fake clock: health, least outstanding,
once-only re-sends, refusals that try another daemon."""

from __future__ import annotations

import pytest

from modelwarden.client.balancer import Balancer, Health, Next
from modelwarden.testing import ManualClock

A, B, C = "tcp://a:5555", "tcp://b:5555", "tcp://c:5555"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def balancer_with(clock: ManualClock, endpoints=(A, B), up=(A, B)) -> Balancer:
    balancer = Balancer(list(endpoints), clock, heartbeat_interval=1.0, heartbeat_timeout=5.0)
    balancer.heartbeats_due()
    for endpoint in up:
        balancer.heartbeat_answered(endpoint)
    return balancer


def test_requests_go_to_the_endpoint_with_the_fewest_outstanding(clock):
    balancer = balancer_with(clock)
    first = balancer.route(balancer.add(1, 10))
    second = balancer.route(balancer.add(2, 10))
    assert {first, second} == {A, B}
    balancer.finished(balancer.tickets[1])  # `first` is idle again, the other holds one
    assert balancer.route(balancer.add(3, 10)) == first
    assert balancer.outstanding(A) == balancer.outstanding(B) == 1


def test_ties_go_round_robin(clock):
    balancer = balancer_with(clock, endpoints=(A, B, C), up=(A, B, C))
    chosen = []
    for key in range(6):
        ticket = balancer.add(key, 10)
        chosen.append(balancer.route(ticket))
        balancer.finished(ticket)
    assert chosen.count(A) == chosen.count(B) == chosen.count(C) == 2


def test_only_up_endpoints_get_requests_and_none_up_parks_them(clock):
    balancer = balancer_with(clock, up=())
    assert balancer.healthy() == []
    ticket = balancer.add(1, 10)
    assert balancer.route(ticket) is None and balancer.parked == [ticket]
    assert balancer.heartbeat_answered(B) is True  # B came up: the caller routes the parked
    assert balancer.unpark() == [ticket]
    assert balancer.route(ticket) == B and balancer.parked == []


def test_a_silent_endpoint_goes_down_and_comes_back_when_it_answers(clock):
    balancer = balancer_with(clock)
    clock.now += 1.0
    assert sorted(balancer.heartbeats_due()) == [A, B]
    assert balancer.heartbeats_due() == []  # one heartbeat outstanding at a time
    balancer.heartbeat_answered(B)
    clock.now += 4.9
    assert balancer.silent() == []
    clock.now += 0.1  # A's heartbeat is 5 s old
    assert balancer.silent() == [A]
    balancer.lost(A, "silent")
    assert balancer.endpoints[A].health is Health.DOWN and balancer.healthy() == [B]
    assert A in balancer.heartbeats_due()  # a DOWN daemon is still asked, so it can come back
    assert balancer.heartbeat_answered(A) is True
    assert sorted(balancer.healthy()) == [A, B]


def test_next_wakeup_is_the_nearest_heartbeat_or_deadline(clock):
    balancer = balancer_with(clock)
    assert balancer.next_wakeup() == clock.now + 1.0  # the next heartbeats
    balancer.route(balancer.add(1, 0.5))
    assert balancer.next_wakeup() == clock.now + 0.5
    clock.now += 0.5
    assert [ticket.key for ticket in balancer.expired()] == [1]
    assert balancer.tickets == {} and balancer.outstanding(A) + balancer.outstanding(B) == 0


def test_a_lost_endpoints_requests_are_resent_once_then_poison(clock):
    balancer = balancer_with(clock)
    ticket = balancer.add(1, 10)
    first = balancer.route(ticket)
    other = B if first == A else A
    resend, fail = balancer.lost(first, "connection dropped")
    assert resend == [ticket] and fail == []
    assert balancer.route(ticket) == other and ticket.runs == 2
    balancer.heartbeat_answered(first)  # back, but the request has run its two times
    resend, fail = balancer.lost(other, "connection dropped")
    assert resend == [] and fail == [ticket]
    assert balancer.tickets == {}


def test_a_lost_endpoint_with_no_other_up_parks_its_requests(clock):
    balancer = balancer_with(clock, up=(A,))
    ticket = balancer.add(1, 10)
    assert balancer.route(ticket) == A
    resend, _ = balancer.lost(A, "connection dropped")
    assert balancer.route(resend[0]) is None and balancer.parked == [ticket]
    balancer.heartbeat_answered(A)  # the same daemon restarted: its one re-send may go there
    assert balancer.route(balancer.unpark()[0]) == A and ticket.runs == 2


def test_a_request_resent_elsewhere_is_not_resent_again_while_the_other_holds_it(clock):
    balancer = balancer_with(clock, endpoints=(A, B, C), up=(A, B, C))
    ticket = balancer.add(1, 10)
    first = balancer.route(ticket)
    balancer.lost(first, "silent")
    second = balancer.route(ticket)
    balancer.heartbeat_answered(first)
    # The first daemon was only slow; losing it again changes nothing: the second holds it.
    assert balancer.lost(first, "silent") == ([], [])
    assert ticket.held_by == [second]


def test_overloaded_tries_every_other_up_endpoint_then_fails(clock):
    balancer = balancer_with(clock, endpoints=(A, B, C), up=(A, B, C))
    ticket = balancer.add(1, 10)
    tried = [balancer.route(ticket)]
    assert balancer.refused(ticket, tried[-1]) is Next.ROUTE
    tried.append(balancer.route(ticket))
    assert balancer.refused(ticket, tried[-1]) is Next.ROUTE
    tried.append(balancer.route(ticket))
    assert sorted(tried) == [A, B, C] and ticket.runs == 1
    assert balancer.refused(ticket, tried[-1]) is Next.FAIL
    assert balancer.tickets == {} and ticket.runs == 0


def test_a_refusal_does_not_wait_for_a_down_endpoint(clock):
    balancer = balancer_with(clock, endpoints=(A, B), up=(A,))
    ticket = balancer.add(1, 10)
    assert balancer.route(ticket) == A
    assert balancer.refused(ticket, A) is Next.FAIL  # B is not UP: fail now, not at the deadline


def test_a_late_refusal_while_another_daemon_holds_the_request_waits(clock):
    balancer = balancer_with(clock)
    ticket = balancer.add(1, 10)
    first = balancer.route(ticket)
    balancer.lost(first, "silent")
    second = balancer.route(ticket)
    balancer.heartbeat_answered(first)
    assert balancer.refused(ticket, second) is Next.ROUTE  # nothing else holds it
    assert balancer.route(ticket) == first and ticket.runs == 2


def test_refusals_do_not_count_as_runs_for_the_once_only_rule(clock):
    balancer = balancer_with(clock)
    ticket = balancer.add(1, 10)
    first = balancer.route(ticket)
    balancer.refused(ticket, first)  # OVERLOADED: it never ran there
    second = balancer.route(ticket)
    resend, fail = balancer.lost(second, "connection dropped")
    assert resend == [ticket] and fail == []  # one run so far: one re-send is still allowed


def test_an_endpoint_listed_twice_is_an_error(clock):
    with pytest.raises(ValueError, match="listed twice"):
        Balancer([A, A], clock)


def test_the_least_busy_endpoint_wins_whatever_the_rotation(clock):
    balancer = balancer_with(clock, endpoints=(A, B, C), up=(A, B, C))
    tickets = [balancer.add(key, 10) for key in range(6)]
    for ticket in tickets:
        balancer.route(ticket)
    for ticket in tickets:
        if ticket.held_by == [C]:
            balancer.finished(ticket)
    assert [balancer.route(balancer.add(key, 10)) for key in (10, 11)] == [C, C]
    assert balancer.outstanding(A) == balancer.outstanding(B) == balancer.outstanding(C) == 2
