"""Memory bounds: what one message, one connection and the whole daemon may make the supervisor
hold, and what a peer gets at each bound.

* One message: at most ``MAX_FRAMES`` frames (MAX_TENSORS payload frames plus the envelope) and
  ``max_message_bytes`` in all -> BAD_REQUEST, and the frames are released at once. ZeroMQ limits
  each *frame* (``ZMQ_MAXMSGSIZE``, the same ``max_message_bytes``; a larger frame disconnects
  the peer) but not the number of frames: libzmq assembles the whole multipart message in its
  I/O thread before the loop sees any of it, so until the loop refuses it one message holds up
  to frames x ``max_message_bytes``, and ZeroMQ puts no bound on its frames (``ZMQ_RCVHWM``
  counts whole messages). These checks bound what stays held after receipt, not that window.
* Requests (``RequestBytes``): the inline payload bytes of accepted, unanswered requests, per
  connection and in all. A request that would pass either cap is answered OVERLOADED.
* Replies (``ReplyLedger``): reply bytes sent to a connection that libzmq has not yet written
  to the kernel -- a peer that does not read. Large replies carry a tracked frame
  (``zmq.Frame(track=True)``: done when libzmq frees the message, which it does once it is
  written); small ones get one every ``TRACK_EVERY`` bytes, and since one peer's messages are
  written in order, a done tracker proves every earlier reply written. A reply that would pass
  the connection's or the daemon's cap is replaced by a small OVERLOADED error (every accepted
  request still gets exactly one answer), and the connection's new requests are answered
  OVERLOADED until its backlog is written. Bound: per connection ``max_unread_bytes_per_connection``
  + 3 x ``TRACK_EVERY`` (bytes not yet covered by a tracker, and once, those a quiet
  connection's forgotten backlog had not covered: ``sweep``) + one reply; in all
  ``max_unread_bytes`` + 3 x ``TRACK_EVERY`` per connection + one reply. Error and hello
  replies are not counted; they are small and, per connection, at most the frontend's
  ``ZMQ_SNDHWM`` in number. The daemon's own gateway's connection (``uncapped``: the local
  frontends know it by its pid) is bound by the daemon's cap alone: it answers many callers over
  one connection and bounds each of them itself (gateway/quota.py), and a burst of large replies
  its event loop reads a moment late is not dropped.

A connection is ``(frontend index, routing id)``.
Tracking costs about 20 us of CPU per tracked reply (pyzmq's free callback goes through its
garbage-collector thread, which the first tracked reply starts: one thread with its own ZeroMQ
context, about seven descriptors, once per process), which is why small replies are tracked only
every ``TRACK_EVERY``, and on a connection's first reply.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import zmq

from modelwarden.shared.protocol import BAD_REQUEST, MAX_TENSORS, OVERLOADED, ProtocolError

logger = logging.getLogger(__name__)

ENVELOPE_FRAMES = 4  # routing id, optional empty delimiter, signature, header
MAX_FRAMES = MAX_TENSORS + ENVELOPE_FRAMES
TRACK_EVERY = 1 << 20  # bytes of small replies between two tracked ones
FORGET_AFTER_SWEEPS = 100  # ticks (10 s) without a reply before untracked bytes are forgotten


def check_message(frames: list, max_bytes: int) -> None:
    """Frames and total bytes of one received message; raises BAD_REQUEST."""
    if len(frames) > MAX_FRAMES:
        raise oversized(len(frames), 0, max_bytes)
    total = 0
    for frame in frames:
        total += len(frame)
    if total > max_bytes:
        raise oversized(len(frames), total, max_bytes)


def oversized(count: int, total: int, max_bytes: int) -> ProtocolError:
    """The BAD_REQUEST of a message of ``count`` frames and ``total`` bytes past the bounds
    (also of one a ZMTP frontend read past without holding it: supervisor/routing/zmtpfront.py)."""
    if count > MAX_FRAMES:
        return ProtocolError(BAD_REQUEST, f"message of {count} frames exceeds {MAX_FRAMES} "
                             f"(MAX_TENSORS + {ENVELOPE_FRAMES})")
    return ProtocolError(BAD_REQUEST, f"message of {total} bytes exceeds max_message_bytes "
                         f"({max_bytes})")


class RequestBytes:
    """Inline payload bytes of accepted, unanswered requests, per connection and in all."""

    def __init__(self, per_connection: int, total: int) -> None:
        self.per_connection = per_connection
        self.total_cap = total
        self.total = 0
        self.by_connection: dict[tuple, int] = {}

    def take(self, connection: tuple, nbytes: int) -> None:
        """Account ``nbytes`` for a request about to be accepted, or raise OVERLOADED."""
        if not nbytes:
            return
        held = self.by_connection.get(connection, 0)
        if held + nbytes > self.per_connection:
            raise ProtocolError(OVERLOADED, f"this connection has {held} bytes of requests in "
                                f"flight; {nbytes} more would pass max_request_bytes_per_connection "
                                f"({self.per_connection}); retry later")
        if self.total + nbytes > self.total_cap:
            raise ProtocolError(OVERLOADED, f"the daemon holds {self.total} bytes of requests; "
                                f"{nbytes} more would pass max_request_bytes ({self.total_cap}); "
                                "retry later")
        self.by_connection[connection] = held + nbytes
        self.total += nbytes

    def give_back(self, connection: tuple, nbytes: int) -> None:
        if not nbytes:
            return
        held = self.by_connection.get(connection, 0) - nbytes
        if held > 0:
            self.by_connection[connection] = held
        else:
            self.by_connection.pop(connection, None)
        self.total -= nbytes


class _Backlog:
    """Replies to one connection: tracked bytes sent and known written, trackers not yet done,
    the bytes sent since the last tracked reply (not counted until the next one), and the
    sweeps since the last reply."""

    def __init__(self) -> None:
        self.sent = 0
        self.written = 0
        self.trackers: collections.deque = collections.deque()  # (tracker, sent up to it)
        self.untracked = 0
        self.refusing = False
        self.idle_sweeps = 0

    def settle(self) -> int:
        """Forget done trackers (in order: one peer's messages are written in order); return
        the change in ``unread``."""
        before = self.sent - self.written
        trackers = self.trackers
        while trackers and trackers[0][0].done:
            self.written = trackers.popleft()[1]
        return (self.sent - self.written) - before

    @property
    def unread(self) -> int:
        return self.sent - self.written


class ReplyLedger:
    """Bytes of replies not yet written to each peer; refuses to queue more past the caps."""

    def __init__(self, per_connection: int, total: int) -> None:
        self.per_connection = per_connection
        self.total_cap = total
        self.total = 0
        self.backlogs: dict[tuple, _Backlog] = {}
        self.refusing = 0  # backlogs refusing their connection's requests: none, mostly
        # Connections held to the daemon's cap alone: the gateway's (see the module's docstring).
        self.uncapped: set[tuple] = set()

    def refusal(self, connection: tuple) -> str | None:
        """Why new requests from ``connection`` are refused now, or None."""
        if not self.refusing:
            return None
        backlog = self.backlogs.get(connection)
        if backlog is None or not backlog.refusing:
            return None
        self.total += backlog.settle()
        if backlog.unread <= self.per_connection // 2:
            backlog.refusing = False
            self.refusing -= 1
            return None
        return (f"{backlog.unread} bytes of replies to this connection are unread "
                f"(max_unread_bytes_per_connection {self.per_connection}); read them first")

    def prepare(self, connection: tuple, parts: list, nbytes: int) -> str | None:
        """Account a reply of ``nbytes`` payload bytes about to go out as ``parts``; its last
        frame may be replaced by a tracked copy. A reason instead: over a cap, do not send it."""
        backlog = self.backlogs.get(connection)
        fresh = backlog is None
        if fresh:
            backlog = self.backlogs[connection] = _Backlog()
        elif backlog.trackers:
            self.total += backlog.settle()
        backlog.idle_sweeps = 0
        unread = backlog.unread
        if unread and ((unread + nbytes > self.per_connection and connection not in self.uncapped)
                       or self.total + nbytes > self.total_cap):
            if not backlog.refusing:
                logger.warning("a peer is not reading its replies (%d bytes unread, daemon %d): "
                               "dropping its replies and refusing its requests", unread, self.total)
                backlog.refusing = True
                self.refusing += 1
            return (f"reply dropped: {unread} bytes of earlier replies to this connection are "
                    f"unread (max_unread_bytes_per_connection {self.per_connection}, "
                    f"max_unread_bytes {self.total_cap})")
        backlog.untracked += nbytes
        # A connection's first reply is tracked too. What sweep() forgot of this connection
        # before (untracked bytes, less than TRACK_EVERY) went out ahead of it, and one peer's
        # messages are written in order: until that tracker is done, the backlog is not
        # forgotten again, so a peer that stops reading loses us at most TRACK_EVERY once.
        if fresh or backlog.untracked >= TRACK_EVERY:
            last = parts[-1]
            frame = zmq.Frame(getattr(last, "buffer", last), copy=False, track=True)
            parts[-1] = frame  # the caller drops ``parts`` after sending: the tracker can finish
            backlog.sent += backlog.untracked
            self.total += backlog.untracked
            backlog.untracked = 0
            backlog.trackers.append((frame.tracker, backlog.sent))
        return None

    def sweep(self) -> None:
        """Settle every connection (the loop's tick): a peer that read frees the daemon's share.
        A connection with nothing unread is forgotten once it holds no untracked bytes either,
        or once it has had no reply for FORGET_AFTER_SWEEPS sweeps (its peer gone, most likely:
        a ROUTER says nothing when a peer leaves). Until then its untracked bytes keep adding
        up towards the next tracked reply: forgotten at every quiet moment, small replies would
        never be counted at all."""
        for connection, backlog in list(self.backlogs.items()):
            self.total += backlog.settle()
            backlog.idle_sweeps += 1
            if backlog.unread or backlog.refusing:
                continue
            if not backlog.untracked or backlog.idle_sweeps > FORGET_AFTER_SWEEPS:
                del self.backlogs[connection]


def payload_bytes(frames: Any) -> int:
    total = 0
    if frames:
        for frame in frames:
            total += len(frame)
    return total
