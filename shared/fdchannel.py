"""The buffer channel: clients hand the daemon their shared-memory buffers as file descriptors.

A buffer is anonymous memory (``memfd_create``), sealed so it can never shrink. It has no name:
nobody can list, open or squat it. The only way to reach it is to be given its descriptor, and
the only way to use it in a request is to present the token the daemon answered for it. A token is
a capability: whoever holds it may reference the buffer, for as long as the Unix connection that
registered it stays open.

Transport
=========
An AF_UNIX SOCK_SEQPACKET socket, ``RUNTIME_DIR/buffers.sock`` (``hello`` says the path, under
``shm.channel``). Every message -- either way -- is ONE SEQPACKET message holding ONE msgpack map
(at most MAX_MESSAGE_BYTES); descriptors travel with it as SCM_RIGHTS ancillary data. Requests are
answered in order, one reply each; ``id`` (an int or a str of at most 128 bytes) is echoed.

``register``: 1..MAX_FDS_PER_MESSAGE descriptors, in the ancillary data of the message::

    {"type": "register", "id": 1}                 + fds [A, B]
    -> {"id": 1, "ok": true, "tokens": ["<32 hex>", "<32 hex>"]}   one token per fd, in order

Each fd must be a regular file of size > 0 sealed at least against shrinking (F_SEAL_SHRINK, as
``fcntl(fd, F_GET_SEALS)`` reports): a sealed memfd. The daemon keeps its own copy of the
descriptor (the client may close its own); the buffer's size is its size at registration, which
sealing makes permanent. All or nothing: one refused fd refuses the whole message.

``unregister``: revoke tokens this connection registered (others' tokens are ignored)::

    {"type": "unregister", "id": 2, "tokens": ["<32 hex>", ...]}
    -> {"id": 2, "ok": true}

Errors use the main protocol's shape and codes::

    {"id": 1, "ok": false, "error": {"code": "BAD_REQUEST", "message": "..."}}

Closing the connection revokes every token it registered: the daemon closes its descriptors and
tells its workers to forget them. Descriptors received with a refused message are closed at once.
Limits: MAX_FDS_PER_MESSAGE per message, a per-connection and a daemon-wide buffer count
(``supervisor/routing/buffers.py``); exceeding one is BAD_REQUEST. A message cut short (MSG_TRUNC) or
whose descriptors did not fit (MSG_CTRUNC) is refused.

Using a buffer
==============
On the ZeroMQ frontend a tensor descriptor names ``"shm": [TOKEN, OFFSET, NBYTES]`` and a request
may name an output region ``"out": [TOKEN, OFFSET, NBYTES]`` (see ``shared/protocol.py``). An
unknown or revoked token is BAD_REQUEST with detail ``buffer_not_registered``: reconnect the
channel, register the buffers again (new tokens) and resend.

This module holds the framing both sides use, and the client's end of the channel.
"""

from __future__ import annotations

import array
import errno
import os
import socket
import threading
from typing import Any

import msgpack

from modelwarden.shared import protocol
from modelwarden.shared.protocol import ProtocolError, bad

MAX_MESSAGE_BYTES = 64 * 1024
MAX_FDS_PER_MESSAGE = 64
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
_UNPACK = dict(max_str_len=MAX_MESSAGE_BYTES, max_bin_len=0, max_array_len=4096,
               max_map_len=64, max_ext_len=0, raw=False, strict_map_key=True)


# Message types on the buffer channels: a client's on ``buffers.sock``, the supervisor's to a
# worker on the worker's buffer socket (worker/segments.py).
REGISTER = "register"      # client -> supervisor, with descriptors: honour these buffers
UNREGISTER = "unregister"  # client -> supervisor: forget these tokens
HAND_OVER = "buffers"      # supervisor -> worker, with descriptors: the buffers a request needs


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or it broke)."""


def send_message(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = protocol.pack(message)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive_message(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it (the caller owns them: it must close
    each one). Raises ChannelClosed at end of stream, BlockingIOError when nothing is there.
    A malformed message gives (None, fds) after closing nothing -- the caller refuses it and
    closes the fds; a truncated one closes its fds here and raises ProtocolError."""
    data, ancdata, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
    fds = _fds_of(ancdata)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_all(fds)
        raise bad(f"message too long or more than {MAX_FDS_PER_MESSAGE} descriptors")
    if not data and not fds:
        raise ChannelClosed("end of stream")
    try:
        message = msgpack.unpackb(data, **_UNPACK)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None, fds
    return (message if isinstance(message, dict) else None), fds


def _fds_of(ancdata: list) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % fds.itemsize
            fds.frombytes(payload[:usable])
    return list(fds)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def parse_token_list(message: dict) -> list[str]:
    tokens = message.get("tokens")
    if not isinstance(tokens, list) or not 0 < len(tokens) <= protocol.MAX_BUFFERS_PER_MESSAGE:
        raise bad(f"'tokens' must list 1 to {protocol.MAX_BUFFERS_PER_MESSAGE} tokens")
    return [protocol.parse_token(token, "token") for token in tokens]


def reply(request_id: Any, **fields: Any) -> dict:
    return {"id": request_id, "ok": True, **fields}


class BufferChannelClient:
    """The client's end: one connection per client, shared by its threads under a lock.

    ``register`` waits for its answer (it is rare: once per new buffer); ``unregister`` does not
    (its answer is dropped by the next ``register``)."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._ids = 0
        self.lock = threading.RLock()

    def connect(self) -> None:
        with self.lock:
            self.close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def register(self, fds: list[int]) -> list[str]:
        """Tokens for ``fds`` (any number: sent MAX_FDS_PER_MESSAGE at a time)."""
        tokens: list[str] = []
        with self.lock:
            if self._sock is None:
                self.connect()
            for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                batch = fds[start:start + MAX_FDS_PER_MESSAGE]
                answer = self._call({"type": REGISTER}, batch)
                got = answer.get("tokens")
                if not isinstance(got, list) or len(got) != len(batch):
                    raise ChannelClosed("the daemon answered register without tokens")
                tokens.extend(got)
        return tokens

    def unregister(self, tokens: list[str]) -> None:
        with self.lock:
            if self._sock is None or not tokens:
                return
            try:
                self._drop_answers()  # earlier unregisters' answers: never let them pile up
                step = protocol.MAX_BUFFERS_PER_MESSAGE
                for start in range(0, len(tokens), step):
                    self._ids += 1
                    send_message(self._sock, {"type": UNREGISTER, "id": self._ids,
                                              "tokens": tokens[start:start + step]})
            except (OSError, ProtocolError):
                self.close()  # the daemon is gone: so are the tokens

    def _drop_answers(self) -> None:
        while True:
            try:
                data, ancdata, _, _ = self._sock.recvmsg(MAX_MESSAGE_BYTES, _FD_SPACE,
                                                         socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            close_all(_fds_of(ancdata))
            if not data:
                raise ChannelClosed("end of stream")

    def _call(self, message: dict, fds: list[int]) -> dict:
        self._ids += 1
        request_id = self._ids
        try:
            send_message(self._sock, {**message, "id": request_id}, fds)
            while True:
                answer, extra = receive_message(self._sock)
                close_all(extra)  # the daemon never sends descriptors: drop any
                if answer is not None and answer.get("id") == request_id:
                    break
        except (OSError, ProtocolError) as exc:
            self.close()
            if isinstance(exc, ChannelClosed):
                raise
            raise ChannelClosed(f"buffer channel {self.path}: {exc}") from None
        if not answer.get("ok"):
            error = answer.get("error") or {}
            raise ProtocolError(error.get("code", protocol.INTERNAL), error.get("message", "refused"))
        return answer

    def close(self) -> None:
        with self.lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def is_gone(exc: OSError) -> bool:
    """A send that failed because the peer is gone (not because its queue is full)."""
    return exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)
