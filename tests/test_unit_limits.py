"""Unit tests for the byte ledgers and the connection marks (no daemon; real pyzmq frames)."""

from __future__ import annotations

import gc
import os
import stat
import logging

import pytest
import zmq

from modelwarden.shared.protocol import BAD_REQUEST, OVERLOADED, ProtocolError
from modelwarden.supervisor.routing.connections import ConnectionGuard, Listener
from modelwarden.supervisor.routing.limits import (FORGET_AFTER_SWEEPS, MAX_FRAMES, TRACK_EVERY, ReplyLedger,
                                                   RequestBytes, check_message)
from tests.helpers import poll_until

PEER = (0, b"peer")
OTHER = (0, b"other")


def test_a_message_is_checked_for_frames_and_total_bytes():
    check_message([b"x"] * MAX_FRAMES, MAX_FRAMES)
    with pytest.raises(ProtocolError) as too_many:
        check_message([b"x"] * (MAX_FRAMES + 1), 1 << 20)
    with pytest.raises(ProtocolError) as too_big:
        check_message([b"x" * 600, b"y" * 600], 1000)
    assert too_many.value.code == too_big.value.code == BAD_REQUEST
    assert "max_message_bytes (1000)" in too_big.value.message


def test_request_bytes_are_capped_per_connection_and_in_all_and_given_back():
    ledger = RequestBytes(per_connection=100, total=150)
    ledger.take(PEER, 100)
    with pytest.raises(ProtocolError) as per_connection:
        ledger.take(PEER, 1)
    ledger.take(OTHER, 50)
    with pytest.raises(ProtocolError) as in_all:
        ledger.take(OTHER, 1)
    assert per_connection.value.code == in_all.value.code == OVERLOADED
    assert "max_request_bytes_per_connection" in per_connection.value.message
    assert "max_request_bytes (150)" in in_all.value.message
    ledger.give_back(PEER, 100)
    ledger.give_back(OTHER, 50)
    assert ledger.total == 0 and ledger.by_connection == {}


def test_unwritten_replies_are_capped_and_released_once_written():
    ledger = ReplyLedger(per_connection=3 * TRACK_EVERY, total=1 << 40)
    sent = []
    for _ in range(3):
        parts = [b"route", b"MWP1", b"header", bytes(TRACK_EVERY)]
        assert ledger.prepare(PEER, parts, TRACK_EVERY) is None
        sent.append(parts)  # held, as libzmq holds what the peer has not read
    refusal = ledger.prepare(PEER, [b"route", bytes(TRACK_EVERY)], TRACK_EVERY)
    assert refusal is not None and "max_unread_bytes_per_connection" in refusal
    assert ledger.refusal(PEER) is not None and ledger.refusal(OTHER) is None
    assert ledger.refusing == 1  # what the router asks before it looks a connection up
    assert ledger.prepare(OTHER, [b"route", bytes(TRACK_EVERY)], TRACK_EVERY) is None
    sent.clear()  # "written": the tracked frames are freed
    gc.collect()
    poll_until(lambda: ledger.refusal(PEER) is None, 5, message="the backlog written")
    assert ledger.refusing == 0
    assert ledger.prepare(PEER, [b"route", bytes(TRACK_EVERY)], TRACK_EVERY) is None


def test_an_uncapped_connection_is_held_to_the_daemons_cap_alone():
    """The gateway answers many callers over one connection: a burst of large replies its loop
    reads late passes the per-connection cap, and only the daemon's refuses."""
    ledger = ReplyLedger(per_connection=2 * TRACK_EVERY, total=5 * TRACK_EVERY)
    ledger.uncapped.add(PEER)
    held = []
    for _ in range(4):
        parts = [b"route", b"MWP1", b"header", bytes(TRACK_EVERY)]
        assert ledger.prepare(PEER, parts, TRACK_EVERY) is None
        held.append(parts)
    assert ledger.refusal(PEER) is None
    refusal = ledger.prepare(PEER, [b"route", bytes(2 * TRACK_EVERY)], 2 * TRACK_EVERY)
    assert refusal is not None and "max_unread_bytes 5" in refusal
    # Anyone else: the connection's own cap, as before.
    assert ledger.prepare(OTHER, [b"route", bytes(TRACK_EVERY)], TRACK_EVERY) is None


def test_small_unread_replies_add_up_to_a_refusal():
    """1 KiB replies the peer never reads: each is below TRACK_EVERY, but together they are
    tracked and counted, and the connection's cap refuses them."""
    ledger = ReplyLedger(per_connection=2 * TRACK_EVERY, total=1 << 40)
    held = []  # what libzmq would hold for a peer that does not read
    for count in range(4 * TRACK_EVERY // 1024):
        parts = [b"route", b"MWP1", b"header", bytes(1024)]
        if ledger.prepare(PEER, parts, 1024) is not None:
            break
        held.append(parts)
    else:
        pytest.fail("4 MiB of small unread replies were never refused")
    assert 2 * TRACK_EVERY // 1024 <= count <= 3 * TRACK_EVERY // 1024 + 1
    assert ledger.refusal(PEER) is not None


def test_a_quiet_connection_is_forgotten_only_once_its_untracked_bytes_have_waited():
    ledger = ReplyLedger(per_connection=1 << 30, total=1 << 40)
    first = [b"route", bytes(1024)]
    assert ledger.prepare(PEER, first, 1024) is None  # a first reply: tracked
    assert ledger.prepare(PEER, [b"route", bytes(1024)], 1024) is None  # untracked
    first.clear()
    gc.collect()
    poll_until(lambda: (ledger.sweep(), ledger.total)[1] == 0, 5, message="the first reply written")
    for _ in range(FORGET_AFTER_SWEEPS - 1):
        ledger.sweep()
        assert PEER in ledger.backlogs, "forgotten while its untracked bytes were recent"
    ledger.sweep()
    ledger.sweep()
    assert PEER not in ledger.backlogs
    # Its next reply is a first one again: tracked, so what was forgotten is covered by it.
    assert ledger.prepare(PEER, [b"route", bytes(1024)], 1024) is None
    assert ledger.backlogs[PEER].trackers and ledger.total == 1024


def test_a_connection_with_nothing_untracked_is_forgotten_at_the_next_sweep():
    ledger = ReplyLedger(per_connection=1 << 30, total=1 << 40)
    parts = [b"route", bytes(1024)]
    assert ledger.prepare(OTHER, parts, 1024) is None
    parts.clear()
    gc.collect()
    poll_until(lambda: (ledger.sweep(), OTHER not in ledger.backlogs)[1], 5,
               message="a written connection forgotten")
    assert ledger.total == 0


def test_the_guard_pauses_at_the_high_water_mark_and_resumes_below_the_low_one():
    fds = {"open": 100}
    guard = ConnectionGuard(fd_limit=1000, max_connections=50, count_fds=lambda: fds["open"])
    guard.start(worker_slots=2)
    assert guard.high_water == 50 and guard.low_water == 45
    guard.connections = 50
    guard._decide()
    assert guard.paused and not guard.can_accept()
    guard.connections = 46
    guard._decide()
    assert guard.paused
    guard.connections = 45
    guard._decide()
    assert not guard.paused and guard.can_accept()


def test_the_guard_pauses_when_descriptors_run_low_whatever_the_count():
    fds = {"open": 100}
    guard = ConnectionGuard(fd_limit=1000, max_connections=None, count_fds=lambda: fds["open"])
    guard.start(worker_slots=0)
    assert guard.high_water == 1000 - 100 - guard.reserve
    fds["open"] = 1000 - guard.reserve + 1  # something else took descriptors
    guard.tick()  # measured at each tick
    assert guard.paused
    fds["open"] = 100
    guard.tick()
    assert not guard.paused


def test_the_guard_is_paused_whenever_it_would_refuse_every_connection():
    """At exactly the reserve free, ``can_accept`` says no: a listener the loop accepts on itself
    (buffers.sock, unix://) must be out of the poller then, or it accepts and closes for ever."""
    fds = {"open": 100}
    guard = ConnectionGuard(fd_limit=1000, max_connections=None, count_fds=lambda: fds["open"])
    guard.start(worker_slots=0)
    fds["open"] = 1000 - guard.reserve - 1
    guard.tick()
    assert guard.can_accept() and not guard.paused
    guard.charge(1)  # one more accepted: nothing above the reserve is left
    assert not guard.can_accept() and guard.paused


def test_failed_handshakes_are_logged_once_a_minute_per_endpoint(caplog):
    now = [100.0]
    guard = ConnectionGuard(fd_limit=1024, max_connections=None, count_fds=lambda: 10,
                            clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="modelwarden.supervisor.routing.connections"):
        for _ in range(5):
            guard._handshake_failed("tcp://0.0.0.0:5555")
        guard._handshake_failed("tcp://127.0.0.1:6000")
        now[0] += 61
        guard._handshake_failed("tcp://0.0.0.0:5555")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("refused 1 handshake(s) on tcp://0.0.0.0:5555:")
    assert lines[1].startswith("refused 1 handshake(s) on tcp://127.0.0.1:6000:")
    # the four suppressed within the minute are counted in the next line
    assert lines[2].startswith("refused 5 handshake(s) on tcp://0.0.0.0:5555 since the last report")


def test_a_paused_ipc_listener_is_neither_at_its_name_nor_connectable_aside(tmp_path):
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    path = tmp_path / "frontend.sock"
    try:
        sock.bind(f"ipc://{path}")
        os.chmod(path, 0o660)
        listener = Listener(f"ipc://{path}", sock)
        listener.pause()
        aside = tmp_path / ".frontend.sock.paused"
        assert not path.exists() and aside.exists()
        assert stat.S_IMODE(os.stat(aside).st_mode) == 0  # a group member cannot connect to it
        listener.resume()
        assert path.exists() and not aside.exists()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    finally:
        sock.close(0)
        context.term()
