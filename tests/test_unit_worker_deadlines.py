"""worker/serve.py's reading of the deadlines the supervisor sends with each request (``until``,
CLOCK_MONOTONIC microseconds): a request whose turn comes after it is answered TIMEOUT unrun.
tests/test_reliability.py shows it on a real daemon; these pin the message's reading."""

from __future__ import annotations

import time

from modelwarden.worker.serve import _expired, _now_us, _split_members


def test_the_workers_clock_is_the_one_the_supervisor_writes_deadlines_in():
    before = time.monotonic()
    now = _now_us()
    assert int(before * 1_000_000) - 1 <= now <= int(time.monotonic() * 1_000_000) + 1


def test_only_an_int_deadline_in_the_past_has_expired():
    assert _expired(999, 1000) and not _expired(1000, 1000) and not _expired(1001, 1000)
    for missing in (None, 1.5, "1", True, [1]):  # a probe has none; a malformed one never expires
        assert not _expired(missing, 10**18)


def test_a_batchs_members_take_their_own_deadlines_in_order():
    frames = [b"h1", b"p1", b"h2", b"h3", b"p3a", b"p3b"]
    envelope = {"rids": [7, 8, 9], "frames": [2, 1, 3], "until": [100, 200, 300]}
    assert _split_members(envelope, frames) == [(7, 100, [b"h1", b"p1"]), (8, 200, [b"h2"]),
                                                (9, 300, [b"h3", b"p3a", b"p3b"])]


def test_a_batch_without_deadlines_for_every_member_has_none():
    frames = [b"h1", b"h2"]
    for until in (None, [100], "x", [100, 200, 300]):
        envelope = {"rids": [1, 2], "frames": [1, 1], "until": until}
        assert [member[1] for member in _split_members(envelope, frames)] == [None, None]
    assert _split_members({"rids": [1, 2], "frames": [1, 2], "until": [1, 2]}, frames) is None
