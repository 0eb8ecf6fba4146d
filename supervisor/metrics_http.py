"""The metrics port's HTTP server, served from the supervisor's own poll loop: no thread.

Why here and not in a thread: a thread (and a descriptor) per connection let any local user
who held idle connections open fill the supervisor's descriptor table, and libzmq aborts the
whole daemon when its ipc listener meets EMFILE (supervisor/routing/connections.py). Every descriptor
this module holds is bounded and charged to the daemon's one budget.

The host (the Arbiter) lends what BufferServer uses: its poller (``watch(fd, handler)`` runs
``handler`` when ``fd`` is readable, ``unwatch(fd)``), its timers (``call_at(when, fn, *args)``,
``cancel(timer)``), its clock, and ``guard``, the daemon's descriptor account
(``ConnectionGuard``: ``can_accept()``, and ``opened()``/``closed()`` for each connection it
holds; it also pauses this listener with the daemon's others). The contract:

* A non-blocking listening socket and non-blocking connections, all in the loop's one poller;
  the loop never blocks on a peer.
* At most ``MAX_CONNECTIONS`` connections open, at most ``PER_SOURCE`` of them from one source
  address. Beyond that, or when the guard says no, a connection is accepted and closed at once
  (one left in the backlog would wake the level-triggered poll forever).
* One request per connection (HTTP/1.0, ``Connection: close``). A connection that has not sent
  a whole request head (at most ``HEAD_LIMIT`` bytes; more gets 431) within ``TIMEOUT_S`` of
  its accept is closed; so is one whose answer is not read by then: what the kernel takes at
  once is sent, the rest is retried every ``SEND_RETRY_S`` until that deadline, then dropped.
* Refusals and timeouts are logged at most once per ``LOG_EVERY_S`` per source address, with
  the counts since the last line.

Parsing, admission and the refusal log are policy apart from the sockets (``parse_head``,
``Admission``, ``RefusalLog``), tested with an injected clock.
"""

from __future__ import annotations

import collections
import logging
import socket
from dataclasses import dataclass
from typing import Callable, Protocol
from urllib.parse import parse_qs, urlsplit

from modelwarden.shared.config import parse_host_port

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 32  # a scraper or two and a few probes need a handful
PER_SOURCE = 8  # so one address cannot take them all
HEAD_LIMIT = 8192  # a scrape's request head is a few hundred bytes
TIMEOUT_S = 5.0  # from accept to the last byte of the answer
SEND_RETRY_S = 0.02  # the poller watches only for reading: a blocked answer is retried by timer
ACCEPTS_PER_PASS = 64  # one burst per loop pass, so the loop's other work is not starved
BACKLOG = 64
LOG_EVERY_S = 60.0
ACCEPT_PAUSE_S = 1.0  # accept() itself failed (EMFILE): stop accepting for a while

REASONS = {
    "full": f"{MAX_CONNECTIONS} connections open",
    "source": f"{PER_SOURCE} open from this address",
    "budget": "the daemon's descriptor budget is spent",
    "timeout": f"no whole request and answer within {TIMEOUT_S:g}s",
}
STATUS_TEXT = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
               431: "Request Header Fields Too Large", 500: "Internal Server Error",
               503: "Service Unavailable"}


# -- policy -----------------------------------------------------------------------------------


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict  # parse_qs of the target's query
    headers: dict  # lower-case name -> value (the last one given)


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple = ()  # more (name, value) pairs


def parse_head(data: bytes) -> Request | None:
    """The request in ``data``, or None while its head is incomplete; BadRequest when it is too
    long or is not HTTP."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) > HEAD_LIMIT:
            raise BadRequest(431, f"request head over {HEAD_LIMIT} bytes")
        return None
    if end > HEAD_LIMIT:
        raise BadRequest(431, f"request head over {HEAD_LIMIT} bytes")
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/") or not parts[0].isalpha():
        raise BadRequest(400, "not an HTTP request line")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        headers[name.lower()] = value.strip()
    target = urlsplit(parts[1])
    return Request(parts[0], target.path, parse_qs(target.query), headers)


def encode_response(response: Response, with_body: bool = True) -> bytes:
    head = [f"HTTP/1.0 {response.status} {STATUS_TEXT.get(response.status, '')}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}", "Connection: close"]
    head.extend(f"{name}: {value}" for name, value in response.headers)
    return "\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + (response.body if with_body else b"")


class Admission:
    """Open connections, in all and per source address."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, per_source: int = PER_SOURCE) -> None:
        self.max_connections = max_connections
        self.per_source = per_source
        self.open = 0
        self.by_source: collections.Counter = collections.Counter()

    def refusal(self, source: str) -> str | None:
        """Why a new connection from ``source`` is refused (a REASONS key), or None."""
        if self.open >= self.max_connections:
            return "full"
        if self.by_source[source] >= self.per_source:
            return "source"
        return None

    def opened(self, source: str) -> None:
        self.open += 1
        self.by_source[source] += 1

    def closed(self, source: str) -> None:
        self.open -= 1
        self.by_source[source] -= 1
        if self.by_source[source] <= 0:
            del self.by_source[source]


class RefusalLog:
    """Counts refusals per source; ``note`` returns a line to log at most once per ``every``."""

    def __init__(self, clock: Callable[[], float], every: float = LOG_EVERY_S) -> None:
        self.clock = clock
        self.every = every
        self._sources: dict[str, tuple[collections.Counter, float | None]] = {}

    def note(self, source: str, reason: str) -> str | None:
        counts, last = self._sources.get(source) or (collections.Counter(), None)
        counts[reason] += 1
        now = self.clock()
        if last is not None and now - last < self.every:
            self._sources[source] = (counts, last)
            return None
        self._forget_quiet(now)
        self._sources[source] = (collections.Counter(), now)
        what = ", ".join(f"{n} ({REASONS.get(why, why)})" for why, n in sorted(counts.items()))
        return f"metrics: closed connection(s) from {source}: {what}" + (
            "" if last is None else " in the last minute")

    def _forget_quiet(self, now: float) -> None:
        # Sources (one per address a peer can use: all of 127/8 on loopback) must not pile up.
        if len(self._sources) > 1024:
            self._sources = {source: entry for source, entry in self._sources.items()
                             if entry[1] is not None and now - entry[1] < self.every}


# -- sockets ----------------------------------------------------------------------------------


class _Connection:
    __slots__ = ("sock", "fd", "source", "received", "pending", "timer", "retry")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.source = source
        self.received = bytearray()
        self.pending: memoryview | None = None  # the answer's unsent bytes
        self.timer = None  # the connection's deadline
        self.retry = None  # the next try at sending ``pending``


class DescriptorAccount(Protocol):
    """What the server asks of the daemon's descriptor account (ConnectionGuard)."""

    def can_accept(self) -> bool: ...

    def opened(self) -> None: ...

    def closed(self) -> None: ...


class HttpServer:
    """One listening address; ``app(request) -> Response`` answers each request in the loop."""

    def __init__(self, address: str, app: Callable[[Request], Response], *, watch: Callable,
                 unwatch: Callable, call_at: Callable, cancel: Callable,
                 clock: Callable[[], float], guard: "DescriptorAccount | None" = None) -> None:
        self.host, self.port = parse_host_port(address)
        self.endpoint = f"http://{address}"
        self.app = app
        self._watch, self._unwatch = watch, unwatch
        self._call_at, self._cancel = call_at, cancel
        self.clock = clock
        self.guard = guard  # the daemon's descriptor account (supervisor/routing/connections.py)
        self.paused = False  # by the guard: the listener is out of the poller
        self.admission = Admission()
        self.refusals = RefusalLog(clock)
        self._listener: socket.socket | None = None
        self._listening = False
        self._connections: dict[int, _Connection] = {}  # fd -> connection

    def listen(self) -> None:
        """Bind (an OSError names what failed) and watch the listener."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart finds TIME_WAIT
            sock.bind((self.host, self.port))
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._resume()

    # -- the guard pauses and resumes this listener with the daemon's others -----------------

    def pause(self) -> None:
        self.paused = True
        if self._listener is not None and self._listening:
            self._listening = False
            self._unwatch(self._listener.fileno())

    def resume(self) -> None:
        self.paused = False
        self._resume()

    def _resume(self) -> None:
        if self._listener is not None and not self._listening and not self.paused:
            self._listening = True
            self._watch(self._listener.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_PASS):
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE/ENFILE: the pending connection would wake us forever
                logger.error("metrics: cannot accept (%s); pausing for %.0fs", exc, ACCEPT_PAUSE_S)
                self._listening = False
                self._unwatch(self._listener.fileno())
                self._call_at(self.clock() + ACCEPT_PAUSE_S, self._resume)
                return
            self._admit_or_close(sock, str(address[0]))

    def _admit_or_close(self, sock: socket.socket, source: str) -> None:
        reason = self.admission.refusal(source) or (
            None if self.guard is None or self.guard.can_accept() else "budget")
        if reason is not None:
            sock.close()  # the reserve pays for this one descriptor, for this moment
            self._note(source, reason)
            return
        sock.setblocking(False)
        conn = _Connection(sock, source)
        self.admission.opened(source)
        if self.guard is not None:
            self.guard.opened()
        self._connections[conn.fd] = conn
        conn.timer = self._call_at(self.clock() + TIMEOUT_S, self._expire, conn)
        self._watch(conn.fd, lambda: self._read(conn))

    def _note(self, source: str, reason: str) -> None:
        line = self.refusals.note(source, reason)
        if line is not None:
            logger.warning("%s", line)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(HEAD_LIMIT + 5 - len(conn.received))  # enough to see it is too long
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not data:  # the peer hung up before its request was whole
            self._close(conn)
            return
        conn.received += data
        try:
            request = parse_head(bytes(conn.received))
        except BadRequest as exc:
            self._answer(conn, Response(exc.status, "text/plain", f"{exc}\n".encode()), True)
            return
        if request is None:
            return
        try:
            response = self.app(request)
        except Exception:  # a bug: answer, and keep the loop going
            logger.exception("metrics: error answering %s %s", request.method, request.path[:64])
            response = Response(500, "text/plain", b"internal error; see the daemon's log\n")
        self._answer(conn, response, request.method != "HEAD")

    def _answer(self, conn: _Connection, response: Response, with_body: bool) -> None:
        # One request per connection: read no more (a peer that keeps sending must not keep
        # the level-triggered poll awake), send, close.
        self._unwatch(conn.fd)
        conn.pending = memoryview(encode_response(response, with_body))
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        conn.retry = None
        try:
            while conn.pending:
                sent = conn.sock.send(conn.pending)
                conn.pending = conn.pending[sent:]
        except BlockingIOError:
            conn.retry = self._call_at(self.clock() + SEND_RETRY_S, self._flush, conn)
            return
        except OSError:  # reset, broken pipe: nobody to answer
            pass
        self._close(conn, watched=False)

    def _expire(self, conn: _Connection) -> None:
        conn.timer = None
        self._note(conn.source, "timeout")
        self._close(conn, watched=conn.pending is None)

    def _close(self, conn: _Connection, watched: bool = True) -> None:
        if self._connections.pop(conn.fd, None) is None:
            return
        if watched:
            self._unwatch(conn.fd)
        self._cancel(conn.timer)
        self._cancel(conn.retry)
        conn.sock.close()
        self.admission.closed(conn.source)
        if self.guard is not None:
            self.guard.closed()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        for conn in list(self._connections.values()):
            self._close(conn, watched=conn.pending is None)
        if self._listener is not None:
            if self._listening:
                self._unwatch(self._listener.fileno())
            self._listener.close()
            self._listener = None
