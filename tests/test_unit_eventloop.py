"""supervisor/eventloop.py: one round of the supervisor's loop, on a real Poller and real
sockets (a socketpair, a ZeroMQ PAIR over ipc://) with its timers on a fake clock.
tests/test_compiled.py runs this file again on the uncompiled path."""

from __future__ import annotations

import logging
import socket

import pytest
import zmq

from modelwarden.shared.sockets import Poller
from modelwarden.supervisor.eventloop import EventLoop
from modelwarden.supervisor.timers import Timers
from modelwarden.testing import ManualClock


@pytest.fixture
def loop():
    return EventLoop(Poller(), Timers(), ManualClock())


@pytest.fixture
def ready_pair():
    """A socketpair whose first end is readable (one byte waits on it)."""
    left, right = socket.socketpair()
    right.send(b"x")
    yield left, right
    left.close()
    right.close()


def test_a_round_runs_the_ready_handlers_then_closes_then_fires_the_due_timers(loop, ready_pair):
    order = []
    left, _ = ready_pair
    loop.watch(left.fileno(), lambda: order.append("ready"))
    loop.timers.call_at(100.0, order.append, "timer")
    loop.turn(lambda: order.append("after"))
    assert order == ["ready", "after", "timer"]


def test_the_wait_is_the_nearest_timer_and_nothing_fires_early(loop):
    fired = []
    loop.timers.call_at(100.05, fired.append, "due")  # 50 ms from the fake clock's now
    loop.turn(lambda: None)  # nothing watched: the poll waits out the timer's 50 ms
    assert fired == []  # the fake clock has not moved: not due yet
    loop.clock.now = 100.05
    loop.turn(lambda: None)
    assert fired == ["due"]


def test_a_handler_that_raises_is_logged_and_the_round_goes_on(loop, ready_pair, caplog):
    left, _ = ready_pair
    after = []

    def broken():
        raise RuntimeError("a bug in a handler")

    loop.watch(left.fileno(), broken)
    with caplog.at_level(logging.ERROR, logger="modelwarden.supervisor.arbiter"):
        loop.turn(lambda: after.append(True))
    assert after == [True]
    assert "unexpected error in broken" in caplog.text and "a bug in a handler" in caplog.text


def test_an_unwatched_item_is_neither_polled_nor_handled(loop, ready_pair):
    left, _ = ready_pair
    seen = []
    loop.watch(left.fileno(), lambda: seen.append("left"))
    loop.unwatch(left.fileno())
    loop.timers.call_at(100.0, seen.append, "timer")  # due at once: the poll does not wait
    loop.turn(lambda: None)
    assert seen == ["timer"] and loop.handlers == {}


def test_a_zmq_socket_with_a_message_is_handled_until_it_is_read(loop, tmp_path):
    context = zmq.Context()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        a.bind(f"ipc://{tmp_path}/pair.sock")
        b.connect(f"ipc://{tmp_path}/pair.sock")
        b.send(b"hello")
        got = []
        loop.watch(a, lambda: got.append(a.recv()))
        loop.timers.call_at(110.0, lambda: None)  # a bound on each wait: 10 s
        loop.turn(lambda: None)
        assert got == [b"hello"]
        loop.clock.now = 110.0  # the next round waits for nothing and finds nothing
        loop.turn(lambda: None)
        assert got == [b"hello"]
    finally:
        a.close(linger=0)
        b.close(linger=0)
        context.term()
