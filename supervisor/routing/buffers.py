"""Which shared-memory buffers the daemon honours, and for how long: the security contract.

The lessons of Triton's CVE-2024-0088 and CVE-2025-23319/23320/23334 (a client could name any
shared-memory region and any offset), and of our own audit of named /dev/shm segments (a group
member could squat a name, a reconnect inherited a dead client's registrations, a root daemon
opened a 0600 segment on a stranger's behalf, the sweeper could be stopped):
  * there are no names. A buffer reaches the daemon only as a file descriptor its owner sent
    over the buffer channel (SCM_RIGHTS): the daemon never opens anything on anyone's behalf, so
    it cannot be a confused deputy, and nothing can be listed or squatted;
  * only sealed memfds are accepted: a regular file of size > 0 whose seals include
    F_SEAL_SHRINK. Its size cannot drop under a worker (no SIGBUS) and is checked once, here;
  * each buffer gets a fresh 128-bit random token; the token is the authority. Any frontend
    connection presenting it may use the buffer, for exactly as long as the channel connection
    that registered it stays open: when it closes (the client exited, or was SIGKILLed), every
    token it registered is revoked, its descriptors closed, workers told to forget them;
  * offset and length are checked against the buffer's size, in Python ints (no overflow),
    before any worker sees the request;
  * tokens never appear in logs, errors, status or any process's command line or environment;
    a peer is logged by its SO_PEERCRED pid/uid/gid;
  * every count is bounded: descriptors per message, buffers per connection, buffers in all;
    and so are bytes, by what a buffer can make the daemon commit (its size, which a worker may
    fault in), not by counts: ``max_buffer_bytes`` in all, and per identity (the peer's uid) a
    share of the buffers and of the bytes (supervisor/routing/quotas.py). A buffer larger than an
    identity's whole share is refused outright (BAD_REQUEST); one that does not fit now is
    OVERLOADED, and fits once the identity's earlier buffers are unregistered.
The supervisor itself never maps a buffer: it only fstat()s it and hands the descriptor on.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

from modelwarden.shared import shm
from modelwarden.shared.protocol import (BAD_REQUEST, BUFFER_NOT_REGISTERED, OVERLOADED,
                                         ProtocolError, bad)
from modelwarden.supervisor.routing.quotas import Quotas

MAX_BUFFERS_PER_CONNECTION = 4096
MAX_BUFFERS = 16384


@dataclass(eq=False)
class Peer:
    """One channel connection, known by its kernel-reported credentials."""

    pid: int
    uid: int
    gid: int
    tokens: set[str] = field(default_factory=set)

    @property
    def identity(self) -> str:
        return f"uid:{self.uid}"

    def __str__(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid}"


@dataclass(eq=False)
class Buffer:
    fd: int
    size: int
    peer: Peer


class BufferRegistry:
    def __init__(self, per_connection: int = MAX_BUFFERS_PER_CONNECTION,
                 total: int = MAX_BUFFERS, max_bytes: int | None = None,
                 quotas: Quotas | None = None) -> None:
        self.per_connection = per_connection
        self.total = total
        self.max_bytes = max_bytes  # None: no cap on the bytes in all (unit tests)
        self.quotas = quotas
        self.bytes = 0
        self._buffers: dict[str, Buffer] = {}

    def register(self, peer: Peer, fds: list[int]) -> list[str]:
        """All or nothing: either every fd is accepted (the registry now owns them) and one token
        each comes back, or ProtocolError and the caller still owns -- and closes -- them all."""
        if len(peer.tokens) + len(fds) > self.per_connection:
            raise bad(f"a connection may register at most {self.per_connection} buffers")
        if len(self._buffers) + len(fds) > self.total:
            raise ProtocolError(OVERLOADED, f"the daemon holds its maximum of {self.total} "
                                "buffers; retry later")
        sizes = []
        for index, fd in enumerate(fds):
            size = shm.sealed_size(fd)
            if size is None:
                raise bad(f"descriptor {index} is not a sealed memfd (a regular file of size > 0 "
                          "sealed with F_SEAL_SHRINK)")
            sizes.append(size)
        self._take_shares(peer, len(fds), sum(sizes), max(sizes))
        tokens = []
        for fd, size in zip(fds, sizes):
            token = secrets.token_hex(16)
            self._buffers[token] = Buffer(fd, size, peer)
            peer.tokens.add(token)
            tokens.append(token)
        self.bytes += sum(sizes)
        return tokens

    def _take_shares(self, peer: Peer, count: int, nbytes: int, largest: int) -> None:
        """The identity's buffers and bytes, then the daemon's bytes; all or none taken."""
        quotas, identity = self.quotas, peer.identity
        if quotas is not None and identity != quotas.house and largest > quotas.shares.buffer_bytes:
            raise bad(f"a buffer of {largest} bytes is larger than {identity}'s whole share "
                      f"(max_buffer_bytes_per_identity {quotas.shares.buffer_bytes})")
        if self.max_bytes is not None and self.bytes + nbytes > self.max_bytes:
            raise ProtocolError(OVERLOADED, f"the daemon holds {self.bytes} bytes of buffers; "
                                f"{nbytes} more would pass max_buffer_bytes ({self.max_bytes}); "
                                "retry later")
        if quotas is not None:
            quotas.take(identity, "buffers", count)
            try:
                quotas.take(identity, "buffer_bytes", nbytes)
            except ProtocolError:
                quotas.give_back(identity, "buffers", count)
                raise

    def unregister(self, peer: Peer, tokens: list[str]) -> list[str]:
        """Revoke those of ``tokens`` that ``peer`` registered; returns them."""
        return self._revoke([token for token in tokens if token in peer.tokens])

    def drop(self, peer: Peer) -> list[str]:
        """The peer's connection closed: revoke everything it registered."""
        return self._revoke(list(peer.tokens))

    def _revoke(self, tokens: list[str]) -> list[str]:
        for token in tokens:
            buffer = self._buffers.pop(token)
            buffer.peer.tokens.discard(token)
            os.close(buffer.fd)
            self.bytes -= buffer.size
            if self.quotas is not None:
                self.quotas.give_back(buffer.peer.identity, "buffers")
                self.quotas.give_back(buffer.peer.identity, "buffer_bytes", buffer.size)
        return tokens

    def check(self, region: tuple[str, int, int], what: str) -> None:
        token, offset, nbytes = region
        buffer = self._buffers.get(token)
        if buffer is None:
            raise ProtocolError(BAD_REQUEST, f"{what}: buffer is not registered (or its channel "
                                "connection closed)", BUFFER_NOT_REGISTERED)
        if offset > buffer.size or nbytes > buffer.size - offset:
            raise bad(f"{what}: region [offset {offset}, +{nbytes}) lies outside the buffer's "
                      f"{buffer.size} bytes")

    def get(self, token: str) -> Buffer | None:
        return self._buffers.get(token)

    def close(self) -> None:
        self._revoke(list(self._buffers))

    def __len__(self) -> int:
        return len(self._buffers)
