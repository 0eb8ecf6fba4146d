"""Shares per identity: what one peer may make the daemon hold, so that no one takes it all.

Every resource an outsider can make the supervisor hold is counted twice: against a daemon-wide
cap (``supervisor/routing/limits.py``, ``supervisor/routing/buffers.py``, ``supervisor/routing/connections.py``) and,
here, against the share of the identity that holds it. An identity (``supervisor/routing/identity.py``)
is the peer's uid on a Unix socket, its CURVE key's name on a CURVE tcp frontend, its address on
plaintext tcp.

The resources and their limits (``[daemon]`` keys; ``shares_from`` fills the defaults):

==================  ================================  =========================================
resource            limit                             default share
==================  ================================  =========================================
``connections``     ``max_connections_per_identity``  a quarter of the connection high-water
                                                      mark (frontends, control, buffers.sock)
``buffers``         ``max_buffers_per_identity``      a quarter of ``MAX_BUFFERS``, or of the
                                                      descriptors left to outsiders if fewer
``buffer_bytes``    ``max_buffer_bytes_per_identity`` a quarter of ``max_buffer_bytes``
``requests``        ``max_requests_per_identity``     half of the smallest ``max_queue``
``request_bytes``   ``max_request_bytes_per_identity`` a quarter of ``max_request_bytes``
==================  ================================  =========================================

The daemon's own user is the house (``house``): the gateway, the operator's tools and the
workers run as it, and it could stop the daemon anyway; only the daemon-wide caps bound it. The
gateway keeps shares of its own, per token (gateway/).

Policy only: no sockets, no clock. ``take`` either counts the amount or raises OVERLOADED naming
the limit, and the caller gives back exactly what it took.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelwarden.shared.protocol import OVERLOADED, ProtocolError

if TYPE_CHECKING:
    from modelwarden.shared.config import Settings

RESOURCES = ("connections", "buffers", "buffer_bytes", "requests", "request_bytes")
LIMIT_KEYS = {resource: f"max_{resource}_per_identity" for resource in RESOURCES}
SHOWN_IDENTITIES = 64  # status and metrics list the identities holding the most, at most this many


@dataclass(frozen=True)
class Shares:
    """One identity's limit for each resource."""

    connections: int
    buffers: int
    buffer_bytes: int
    requests: int
    request_bytes: int

    def of(self, resource: str) -> int:
        return getattr(self, resource)


def default_share(total: int, fraction: int) -> int:
    """``1/fraction`` of a daemon-wide limit, and never all of it (a limit of 1 stays 1)."""
    return max(1, min(total - 1, total // fraction)) if total > 1 else total


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_buffer_bytes(settings: "Settings") -> int:
    """``max_buffer_bytes``, or half the host's memory."""
    return settings.daemon.max_buffer_bytes or host_memory_bytes() // 2


def shares_from(settings: "Settings", connections: int, buffers: int) -> Shares:
    """Each limit the configuration sets, else the default share of its daemon-wide cap:
    ``connections`` is the connection high-water mark; ``buffers`` the registry's count cap, or
    the descriptors outsiders may hold if fewer (each registered buffer holds one)."""
    daemon = settings.daemon
    queues = [model.max_queue for model in settings.models] or [2]
    return Shares(
        connections=daemon.max_connections_per_identity or default_share(connections, 4),
        buffers=daemon.max_buffers_per_identity or default_share(buffers, 4),
        buffer_bytes=daemon.max_buffer_bytes_per_identity or default_share(max_buffer_bytes(settings), 4),
        requests=daemon.max_requests_per_identity or default_share(min(queues), 2),
        request_bytes=daemon.max_request_bytes_per_identity or default_share(daemon.max_request_bytes, 4))


_INDEX = {resource: index for index, resource in enumerate(RESOURCES)}
_REQUESTS, _REQUEST_BYTES = _INDEX["requests"], _INDEX["request_bytes"]


class Quotas:
    """What each identity holds now, against its share. On every request's path (a take and a
    give-back each for requests and bytes): per identity a list of five counts, in the order of
    RESOURCES, so a step is one dict lookup and one item. Compiled (quotas.pxd)."""

    def __init__(self, shares: Shares, house: str | None = None) -> None:
        self.house = house
        self.held: dict[str, list] = {}  # identity -> [count per resource] (none all zeros)
        self.shares = shares

    @property
    def shares(self) -> Shares:
        return self._shares

    @shares.setter
    def shares(self, shares: Shares) -> None:
        self._shares = shares
        self._limits = [shares.of(resource) for resource in RESOURCES]

    def take(self, identity: str, resource: str, amount: int = 1) -> None:
        """Count ``amount`` of ``resource`` for ``identity``, or raise OVERLOADED naming the limit."""
        index = _INDEX[resource]
        held = self.held.get(identity)
        now = (held[index] if held is not None else 0) + amount
        limit = self._limits[index]
        if now > limit and identity != self.house:
            raise _refusal(identity, resource, now - amount, amount, limit)
        if held is None:
            held = self.held[identity] = [0, 0, 0, 0, 0]
        held[index] = now

    def take_request(self, identity: str, nbytes: int) -> None:
        """A request's share, both or neither: ``take(identity, "requests")`` and, for inline
        payload bytes, ``take(identity, "request_bytes", nbytes)``, in one lookup (every request
        takes both)."""
        held = self.held.get(identity)
        requests = (held[_REQUESTS] if held is not None else 0) + 1
        request_bytes = (held[_REQUEST_BYTES] if held is not None else 0) + nbytes
        if identity != self.house:
            limit = self._limits[_REQUESTS]
            if requests > limit:
                raise _refusal(identity, "requests", requests - 1, 1, limit)
            limit = self._limits[_REQUEST_BYTES]
            if nbytes and request_bytes > limit:
                raise _refusal(identity, "request_bytes", request_bytes - nbytes, nbytes, limit)
        if held is None:
            held = self.held[identity] = [0, 0, 0, 0, 0]
        held[_REQUESTS] = requests
        held[_REQUEST_BYTES] = request_bytes

    def give_back_request(self, identity: str, nbytes: int) -> None:
        """What ``take_request(identity, nbytes)`` took."""
        held = self.held.get(identity)
        if held is None:
            return
        requests = held[_REQUESTS] - 1
        request_bytes = held[_REQUEST_BYTES] - nbytes
        held[_REQUESTS] = requests if requests > 0 else 0
        held[_REQUEST_BYTES] = request_bytes if request_bytes > 0 else 0
        if not (held[0] or held[1] or held[2] or held[3] or held[4]):
            del self.held[identity]

    def count(self, identity: str, resource: str, amount: int = 1) -> None:
        """Count what is held already, within its share or not (a connection libzmq accepted
        before the loop could say no: it is counted until it is gone)."""
        held = self.held.get(identity)
        if held is None:
            held = self.held[identity] = [0, 0, 0, 0, 0]
        held[_INDEX[resource]] += amount

    def allows(self, identity: str, resource: str, amount: int = 1) -> bool:
        """Would ``take`` succeed now? (For a connection already made: refused, it is shut.)"""
        return (identity == self.house
                or self.holding(identity, resource) + amount <= self._limits[_INDEX[resource]])

    def give_back(self, identity: str, resource: str, amount: int = 1) -> None:
        held = self.held.get(identity)
        if held is None:
            return
        index = _INDEX[resource]
        left = held[index] - amount
        held[index] = left if left > 0 else 0
        if left <= 0 and not (held[0] or held[1] or held[2] or held[3] or held[4]):
            del self.held[identity]

    def holding(self, identity: str, resource: str) -> int:
        held = self.held.get(identity)
        return held[_INDEX[resource]] if held is not None else 0

    def view(self) -> list[dict]:
        """The identities holding anything, the largest holders first (status, metrics)."""
        rows = [{"identity": identity, **dict(zip(RESOURCES, held))}
                for identity, held in self.held.items()]
        rows.sort(key=lambda row: tuple(-row[resource] for resource in RESOURCES))
        return rows[:SHOWN_IDENTITIES]


def _refusal(identity: str, resource: str, holding: int, amount: int, limit: int) -> ProtocolError:
    return ProtocolError(OVERLOADED, f"{identity} holds {holding} {_unit(resource)}; {amount} more "
                         f"would pass {LIMIT_KEYS[resource]} ({limit}); retry later")


def _unit(resource: str) -> str:
    return {"connections": "connections", "buffers": "registered buffers",
            "buffer_bytes": "bytes of registered buffers", "requests": "requests in flight",
            "request_bytes": "bytes of requests in flight"}[resource]
