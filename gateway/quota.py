"""What one caller of the gateway may hold at once: its share of the calls and request bytes in
flight.

A caller is its *identity* (gateway/access.py ``identity``): its token (named ``token:1a2b3c4d``
after the token's SHA-256 digest, never the token), else its client certificate's subject
(``cert:CN=...``), else its peer (``peer:127.0.0.1``, ``uid:1000`` on a Unix socket). The
gateway as a whole holds at most ``max_requests`` calls and ``max_bytes`` request bytes in
flight; one identity at most ``share`` of each (a quarter by default), so a caller that floods
gets refusals while the others are served. Over its share a call is refused with
``QuotaExceeded`` (OVERLOADED; 429 over REST, RESOURCE_EXHAUSTED over gRPC) naming the limit;
over the gateway's total, with OVERLOADED as the daemon's own overload (503, UNAVAILABLE).

A call is admitted (counted) before its message is read; its bytes are charged as they arrive
(REST: its Content-Length at once when it has one) and everything is given back when it ends.
Policy only: no sockets, no clock; one asyncio loop calls it, so nothing here locks.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelwarden.shared.protocol import OVERLOADED, ProtocolError

MAX_IDENTITIES_SHOWN = 16


class QuotaExceeded(ProtocolError):
    """One identity is over its share (not the gateway over its total): the caller's to fix."""

    def __init__(self, message: str) -> None:
        super().__init__(OVERLOADED, message)


@dataclass(frozen=True)
class Limits:
    max_requests: int  # calls in flight, all identities
    max_bytes: int  # request bytes in flight, all identities
    share: float  # of each, for one identity

    @property
    def identity_requests(self) -> int:
        return max(1, int(self.max_requests * self.share))

    @property
    def identity_bytes(self) -> int:
        return max(1, int(self.max_bytes * self.share))


@dataclass
class Use:
    requests: int = 0
    bytes: int = 0


class Quotas:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = Use()
        self._by_identity: dict[str, Use] = {}

    def admit(self, identity: str) -> "Ticket":
        """A ticket for one call of ``identity``, or QuotaExceeded / OVERLOADED."""
        use = self._by_identity.get(identity) or Use()
        limits = self.limits
        if use.requests >= limits.identity_requests:
            raise QuotaExceeded(f"{identity} has {use.requests} calls in flight at the gateway, its "
                                f"share (identity_share {limits.share:g} of max_requests_in_flight "
                                f"{limits.max_requests}); retry when one has finished")
        if self.total.requests >= limits.max_requests:
            raise ProtocolError(OVERLOADED, f"the gateway has {self.total.requests} calls in flight, "
                                f"its max_requests_in_flight")
        self._by_identity[identity] = use
        use.requests += 1
        self.total.requests += 1
        return Ticket(self, identity, use)

    def usage(self) -> dict[str, dict[str, int]]:
        """The identities holding the most calls now (at most MAX_IDENTITIES_SHOWN)."""
        busiest = sorted(self._by_identity.items(), key=lambda item: -item[1].requests)
        return {identity: {"requests": use.requests, "bytes": use.bytes}
                for identity, use in busiest[:MAX_IDENTITIES_SHOWN]}

    def _charge(self, ticket: "Ticket", nbytes: int) -> None:
        limits, use = self.limits, ticket.use
        if use.bytes + nbytes > limits.identity_bytes:
            raise QuotaExceeded(f"{ticket.identity} would have {use.bytes + nbytes} request bytes in "
                                f"flight at the gateway, over its share (identity_share "
                                f"{limits.share:g} of max_bytes_in_flight {limits.max_bytes})")
        if self.total.bytes + nbytes > limits.max_bytes:
            raise ProtocolError(OVERLOADED, f"the gateway would have {self.total.bytes + nbytes} "
                                f"request bytes in flight, over its max_bytes_in_flight "
                                f"({limits.max_bytes})")
        use.bytes += nbytes
        self.total.bytes += nbytes
        ticket.bytes += nbytes

    def _release(self, ticket: "Ticket") -> None:
        use = ticket.use
        use.requests -= 1
        use.bytes -= ticket.bytes
        self.total.requests -= 1
        self.total.bytes -= ticket.bytes
        if use.requests == 0:  # an identity that holds nothing costs no memory
            self._by_identity.pop(ticket.identity, None)


class Ticket:
    """One admitted call: ``charge`` its bytes as they arrive; leaving the ``with`` gives all
    of it back, whatever happened."""

    def __init__(self, quotas: Quotas, identity: str, use: Use) -> None:
        self.quotas, self.identity, self.use = quotas, identity, use
        self.bytes = 0
        self._released = False

    def charge(self, nbytes: int) -> None:
        self.quotas._charge(self, nbytes)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.quotas._release(self)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
