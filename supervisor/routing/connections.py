"""Connections and file descriptors: the daemon refuses new connections before it runs out.

Why. Every accepted connection costs the supervisor one file descriptor, taken by libzmq's I/O
thread, not by our loop. What libzmq 4.3.5 does when ``accept()`` fails depends on the transport:

* ``src/tcp_listener.cpp`` tolerates ``EMFILE``/``ENFILE``/``ENOBUFS``/``ENOMEM`` (it ignores the
  connection, which stays in the kernel's queue; the level-triggered poller retries at once);
* ``src/ipc_listener.cpp`` line 297 tolerates only ``EAGAIN EWOULDBLOCK EINTR ECONNABORTED EPROTO
  ENFILE``: at ``EMFILE`` its ``errno_assert`` aborts the whole supervisor, and the workers with
  it (``Too many open files (src/ipc_listener.cpp:297)``). The admin socket and an abstract
  ``ipc://@NAME`` frontend are libzmq ipc listeners (the ``ipc://PATH`` frontends and the
  control socket are the loop's own: supervisor/routing/zmtpfront.py); libzmq also asserts when
  it cannot make the eventfd of a new socket.

So the descriptor table must never fill. The contract:

1. ``raise_fd_limit()`` lifts the soft ``RLIMIT_NOFILE`` to the hard limit at start (the workers
   inherit it).
2. A ZeroMQ socket monitor on every client-facing socket counts live connections (``ACCEPTED``
   +1, ``DISCONNECTED`` -1; a connection that never finishes its handshake is dropped by libzmq
   after ``ZMQ_HANDSHAKE_IVL``, 30 s, and counted down then). The monitors sit in the loop's one
   poller.
3. One account for every descriptor an outsider can make the supervisor hold: connections on
   every listener (``tcp://`` and abstract ``ipc://@`` frontends, counted by their monitors;
   the ``ipc://`` and ``unix://`` frontends, ``control.sock``, ``buffers.sock`` and the metrics
   port, which the loop accepts on itself and ``charge``s), the descriptors
   received over ``buffers.sock`` (charged the moment ``recvmsg`` installed them, refunded when
   they are closed or revoked) and nothing else: the supervisor never maps a buffer. The count
   of open descriptors is measured at ticks (each tick while few are open or the account is near
   the mark, else once a second) and kept current between them by those events.
4. At the high-water mark -- ``max_connections`` client connections, or fewer than ``reserve``
   descriptors left -- *every* outsider-facing listener is paused: the frontends,
   ``control.sock``, ``buffers.sock`` and the metrics port. The kernel stops handing them
   connections while every connection already accepted keeps being served, and registrations
   are refused (``can_take``) with a typed OVERLOADED. Below the low-water mark (90 % of the
   high-water mark, and as many descriptors above the reserve free) they resume. Both are
   logged. The admin socket (private: the operator's way in, ``status`` included) and the
   workers' links and buffer pairs are never paused; the reserve keeps their descriptors.
5. Each identity (supervisor/routing/identity.py) may hold a share of the connections
   (``max_connections_per_identity``, supervisor/routing/quotas.py). A connection over its identity's
   share is shut down (``shutdown(2)`` on libzmq's descriptor, which libzmq then closes) as soon
   as the loop sees its ACCEPTED event; one on a listener the loop accepts itself is closed.

Pausing is not ``zmq_unbind``: unbinding terminates the listener together with every session it
accepted (they are its children in libzmq's object tree), which would drop the clients already
being served. Instead:

* an ``ipc://`` listener's socket file is renamed aside (``.NAME.paused`` in the same directory,
  ``SocketFileAside``): new clients get ENOENT; the listening socket, its permissions and its
  accepted connections stay as they are; resuming renames it back. So are libzmq's and the
  loop's own ZMTP listeners' (supervisor/routing/zmtpfront.py: the ``ipc://`` frontends and
  ``control.sock``), which also leave the poller: what connected just before the rename waits in
  the backlog;
* a ``tcp://`` listener gets a classic BPF filter that drops every packet (``SO_ATTACH_FILTER``):
  the kernel runs a listening socket's filter on each SYN, so new clients are not answered (their
  SYNs are retransmitted, and connect once the listener resumes); connections accepted before
  keep their own (empty) filter; resuming detaches it;
* a listener the loop accepts on itself (``buffers.sock``, metrics) is taken out of the poller:
  what connects meanwhile waits in its backlog, or is refused once the backlog is full.

Bursts: the I/O thread accepts whatever arrives until the loop has paused a ZeroMQ listener,
and connections already queued in the kernel (at most ``BACKLOG`` per listener) are accepted
after the pause. ``reserve`` covers both: ``RESERVE_BASE`` for the daemon's own descriptors
(worker sentinels, links and buffer pairs, a respawn's pipes, the admin socket's connections)
plus ``BACKLOG + BURST`` per paused ZeroMQ listener, plus one ``buffers.sock`` message's worth of
descriptors (``MAX_FDS_PER_MESSAGE``: the kernel installs them before the loop can refuse them).

``can_accept()`` is for listeners the loop accepts on itself: when it says no, accept and close
at once (a level-triggered poll would otherwise spin) -- the reserve pays the one descriptor for
that moment.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Protocol

import zmq

from modelwarden.shared.fdchannel import MAX_FDS_PER_MESSAGE
from modelwarden.shared.lograte import LineBudget
from modelwarden.supervisor.routing.identity import of_descriptor
from modelwarden.supervisor.routing.quotas import Quotas

logger = logging.getLogger(__name__)

BACKLOG = 64  # ZMQ_BACKLOG on client-facing listeners: what the kernel queues unaccepted
BURST = 64  # connections the I/O thread may accept in one loop pass before the pause lands
RESERVE_BASE = 128  # the daemon's own descriptors beyond its client connections
FDS_PER_WORKER = 5  # its sentinel, its link, its buffer pair, a respawn's two pipes
MIN_HIGH_WATER = 16
CHEAP_TO_LIST = 4096  # descriptors below which /proc/self/fd is listed at every tick
MEASURE_EVERY_S = 1.0  # above that, at least this often
EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
# A peer without CURVE, or with the wrong server key, fails inside libzmq's handshake before ZAP
# is asked (ZAP refusals are logged per peer by supervisor.auth). libzmq reports these with the
# listening endpoint, not the peer: they are logged per endpoint, with a count, once a minute.
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
HANDSHAKE_LOG_EVERY_S = 60.0
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)

# One classic BPF instruction, "ret #0": accept zero bytes of every packet, i.e. drop it.
_DROP_ALL = (ctypes.c_uint8 * 8).from_buffer_copy(struct.pack("=HBBI", 0x06, 0, 0, 0))
_DROP_ALL_PROG = struct.pack("@HP", 1, ctypes.addressof(_DROP_ALL))


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else int(Path("/proc/sys/fs/nr_open").read_text())
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, target, exc)
        return soft
    if soft != target:
        logger.info("file-descriptor limit raised from %d to %d", soft, target)
    return target


def open_fds() -> int:
    """Descriptors this process has open now (listing the directory itself takes one)."""
    return len(os.listdir("/proc/self/fd")) - 1


class SocketFileAside:
    """An ``ipc://`` listener's socket file, renamed aside while its listener is paused
    (``.NAME.paused`` in the same directory): new clients get ENOENT; the listening socket, its
    permissions and its accepted connections stay as they are. Used for libzmq's listeners
    (``Listener``) and the loop's own ZMTP ones (supervisor/routing/zmtpfront.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mode = 0o600  # the socket file's mode before a pause
        self.moved = False
        self.aside().unlink(missing_ok=True)  # left by a daemon killed while paused

    def move(self) -> None:
        # Mode 0 first: the aside name is listable by the clients' group, and a connect to it
        # must fail too, or a group member could flood past the pause.
        self.mode = stat.S_IMODE(os.stat(self.path).st_mode)
        os.chmod(self.path, 0)
        os.rename(self.path, self.aside())
        self.moved = True

    def restore(self) -> None:
        if self.moved:
            os.rename(self.aside(), self.path)
            os.chmod(self.path, self.mode)
            self.moved = False

    def aside(self) -> Path:
        return self.path.with_name(f".{self.path.name}.paused")


class Listener:
    """One client-facing endpoint, pausable without touching its accepted connections."""

    def __init__(self, endpoint: str, sock: zmq.Socket) -> None:
        self.endpoint = endpoint
        self.paused = False
        self._file: SocketFileAside | None = None
        self._fd: int | None = None
        if endpoint.startswith("ipc://@"):
            logger.warning("%s is an abstract socket (no file to rename): it will not pause "
                           "under load", endpoint)
        elif endpoint.startswith("ipc://"):
            self._file = SocketFileAside(Path(endpoint[len("ipc://"):]))
        else:
            self._fd = _listening_fd(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def pausable(self) -> bool:
        return self._file is not None or self._fd is not None

    def pause(self) -> None:
        if self._file is not None:
            self._file.move()
        elif self._fd is not None:
            _setsockopt_fd(self._fd, SO_ATTACH_FILTER, _DROP_ALL_PROG)
        self.paused = True

    def resume(self) -> None:
        if self._file is not None:
            self._file.restore()
        elif self._fd is not None:
            _setsockopt_fd(self._fd, SO_DETACH_FILTER, struct.pack("i", 0))
        self.paused = False


def _shutdown(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.detach()


def _setsockopt_fd(fd: int, option: int, value: bytes) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, value)
    finally:
        sock.detach()  # the descriptor is libzmq's: never close it here


def _listening_fd(last_endpoint: str) -> int | None:
    """The descriptor of the TCP listener libzmq bound at ``tcp://HOST:PORT`` (libzmq does not
    expose it; we find it among our own descriptors by its address)."""
    host, _, port = last_endpoint[len("tcp://"):].rpartition(":")
    wanted = (host.strip("[]"), int(port))
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            if listening and sock.type == socket.SOCK_STREAM and sock.getsockname()[:2] == wanted:
                return fd
        except OSError:
            pass
        finally:
            sock.detach()
    logger.warning("cannot find the listener of %s: it will not pause under load", last_endpoint)
    return None


class Pausable(Protocol):
    """A listener the guard pauses and resumes (``Listener`` below, ``BufferServer``, metrics)."""

    endpoint: str
    paused: bool

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ConnectionGuard:
    """The descriptor account: counts client connections and descriptors held for outsiders,
    pauses and resumes every outsider-facing listener around the marks, and keeps each
    identity's connections within its share."""

    def __init__(self, fd_limit: int, max_connections: int | None, count_fds=open_fds,
                 clock=time.monotonic, quotas: Quotas | None = None) -> None:
        self.fd_limit = fd_limit
        self.clock = clock
        self.failed_handshakes = LineBudget(HANDSHAKE_LOG_EVERY_S)  # lines per listening endpoint
        self.max_connections = max_connections
        self.count_fds = count_fds
        self.quotas = quotas
        self.connections = 0
        self.paused = False
        self.listeners: list[Pausable] = []
        self.monitors: list[zmq.Socket] = []
        self._peers: dict[tuple[int, int], str] = {}  # (monitor, fd) -> the connection's identity
        self.shut = LineBudget(HANDSHAKE_LOG_EVERY_S)  # lines about shut connections, per identity
        self.open = count_fds()  # descriptors open now: measured at ticks, kept current between
        self._measured_at = clock()
        self.reserve = RESERVE_BASE
        self.room = MIN_HIGH_WATER
        self.high_water = MIN_HIGH_WATER
        self.low_water = MIN_HIGH_WATER - 1

    def watch(self, sock: zmq.Socket, endpoint: str, pausable: bool) -> zmq.Socket:
        """Count ``sock``'s connections (and pause its listener if ``pausable``); return the
        monitor socket, to register in the loop's poller with ``on_monitor`` as handler."""
        if pausable:
            self.listeners.append(Listener(endpoint, sock))
        monitor = sock.get_monitor_socket(EVENTS)
        self.monitors.append(monitor)
        return monitor

    def add_listener(self, listener: Pausable) -> None:
        """A listener the loop accepts on itself: paused and resumed with the others."""
        self.listeners.append(listener)
        if self.paused:
            listener.pause()

    def start(self, worker_slots: int) -> None:
        """Fix the marks once every socket is bound: what is open now is the daemon's own."""
        zmq_listeners = sum(isinstance(each, Listener) and each.pausable for each in self.listeners)
        self.reserve = (RESERVE_BASE + (BACKLOG + BURST) * zmq_listeners
                        + FDS_PER_WORKER * worker_slots + MAX_FDS_PER_MESSAGE)
        self.open = self.count_fds()
        room = self.fd_limit - self.open - self.reserve
        if room < MIN_HIGH_WATER:
            logger.warning("file-descriptor limit %d leaves room for %d client connections "
                           "(reserve %d); raise LimitNOFILE", self.fd_limit, max(room, 0), self.reserve)
        self.room = max(MIN_HIGH_WATER, room)  # descriptors outsiders may hold in all
        self.high_water = max(MIN_HIGH_WATER, min(room, self.max_connections or room))
        self.low_water = min(self.high_water * 9 // 10, self.high_water - 1)
        logger.info("client connections: at most %d (fd limit %d, reserve %d)",
                    self.high_water, self.fd_limit, self.reserve)

    def opened(self) -> None:
        """A listener the loop serves itself accepted a connection (its identity's share was
        taken by the caller)."""
        self.connections += 1
        self.charge(1)
        if not self.paused and self.connections >= self.high_water:
            self._pause()

    def closed(self) -> None:
        self.connections = max(0, self.connections - 1)
        self.refund(1)

    def charge(self, count: int) -> None:
        """``count`` descriptors were just opened for an outsider (a connection accepted by the
        loop, descriptors received): at the mark, pause before the next one."""
        self.open += count
        if not self.paused and self._free() <= self.reserve:
            self._pause()

    def refund(self, count: int) -> None:
        """``count`` descriptors charged before are closed."""
        self.open -= count

    def can_take(self, count: int = 0) -> bool:
        """May outsiders hold ``count`` more descriptors, beyond those already charged?"""
        return self._free() - count >= self.reserve

    def on_monitor(self, monitor: zmq.Socket) -> None:
        """Take every event waiting on one monitor, then decide once."""
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event, value = struct.unpack("=HI", frames[0][:6])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(monitor, value)
            elif event == zmq.EVENT_DISCONNECTED:
                self._disconnected(monitor, value)
            elif event == zmq.EVENT_ACCEPT_FAILED:
                logger.warning("accept failed on %s: %s", frames[1].decode(errors="replace"),
                               os.strerror(value) if value else "unknown error")
            elif event in HANDSHAKE_FAILED:
                self._handshake_failed(frames[1].decode(errors="replace"))
        self._decide()

    def _accepted(self, monitor: zmq.Socket, fd: int) -> None:
        self.connections += 1
        self.open += 1
        if self.quotas is None:
            return
        identity = of_descriptor(fd)
        self._peers[(id(monitor), fd)] = identity
        over = not self.quotas.allows(identity, "connections")
        self.quotas.count(identity, "connections")  # held until its DISCONNECTED, shut or not
        if over:
            # libzmq owns the descriptor: shutting it down (not closing it) makes libzmq see the
            # end of the stream and close it itself, with a DISCONNECTED event.
            try:
                _shutdown(fd)
            except OSError:  # closed already: its DISCONNECTED event follows
                pass
            self._shut_over_share(identity)

    def _disconnected(self, monitor: zmq.Socket, fd: int) -> None:
        self.connections = max(0, self.connections - 1)
        self.open -= 1
        identity = self._peers.pop((id(monitor), fd), None)
        if identity is not None and self.quotas is not None:
            self.quotas.give_back(identity, "connections")

    def _shut_over_share(self, identity: str) -> None:
        """Say so at most once a minute per identity, with a count."""
        count = self.shut.due(identity, self.clock())
        if count:
            logger.warning("shut %d connection(s) of %s over its share "
                           "(max_connections_per_identity %d)%s", count, identity,
                           self.quotas.shares.connections,
                           " since the last report" if count > 1 else "")

    def _handshake_failed(self, endpoint: str) -> None:
        """Count a refused handshake; say so at most once a minute per endpoint."""
        count = self.failed_handshakes.due(endpoint, self.clock())
        if count:
            logger.warning("refused %d handshake(s) on %s%s: a peer without CURVE, with the wrong "
                           "server key, or not speaking ZMTP", count, endpoint,
                           " since the last report" if count > 1 else "")

    def tick(self) -> None:
        """Measure what is open (descriptors come and go without events: a worker gone, a
        respawn's pipes), then decide. Listing /proc/self/fd costs about a millisecond per
        thousand descriptors: with many open, it is listed once a MEASURE_EVERY_S unless the
        account is near the mark, and the events keep the count current in between."""
        now = self.clock()
        if (self.open < CHEAP_TO_LIST or self.paused or self._free() < 2 * self.reserve
                or now - self._measured_at >= MEASURE_EVERY_S):
            self.open = self.count_fds()
            self._measured_at = now
        self._decide()

    def can_accept(self) -> bool:
        """May a listener the loop serves itself accept one more connection now?"""
        return not self.paused and self._free() > self.reserve

    def _decide(self) -> None:
        if not self.paused:
            # No descriptor left above the reserve is the mark too: ``can_accept`` refuses every
            # connection there, and a listener left in the poller would accept and close each.
            if self.connections >= self.high_water or self._free() <= self.reserve:
                self._pause()
        elif (self.connections <= self.low_water
              and self._free() >= self.reserve + self.high_water - self.low_water):
            self._resume()

    def _free(self) -> int:
        return self.fd_limit - self.open

    def _pause(self) -> None:
        self.paused = True
        for listener in self.listeners:
            try:
                listener.pause()
            except OSError as exc:
                logger.error("cannot pause %s: %s", listener.endpoint, exc)
        logger.warning("%d client connections, %d descriptors free: new connections paused on %s",
                       self.connections, self._free(),
                       " ".join(listener.endpoint for listener in self.listeners) or "nothing")

    def _resume(self) -> None:
        self.paused = False
        for listener in self.listeners:
            if listener.paused:
                try:
                    listener.resume()
                except OSError as exc:  # the file was removed under us: nothing to put back
                    logger.error("cannot resume %s: %s", listener.endpoint, exc)
        logger.warning("%d client connections: accepting new connections again", self.connections)

    def close(self) -> None:
        """Put paused socket files back (libzmq unlinks them at close) and stop the monitors."""
        for listener in self.listeners:
            if isinstance(listener, Listener) and listener.paused:
                try:
                    listener.resume()
                except OSError:
                    pass
        for monitor in self.monitors:
            monitor.close(0)
