"""Which daemon gets a request, for a client that knows several: the policy, with no sockets.

The multi-endpoint client (client/multiclient.py) owns the sockets and asks this module what to
do; time is passed in (``clock``), so the whole policy is unit-tested with a fake clock
(tests/test_unit_balancer.py). docs/PROTOCOL.md section 11 states the same rules for clients in
other languages.

Health of an endpoint (one daemon)::

    UNKNOWN --heartbeat answered--> UP --heartbeat unanswered for heartbeat_timeout--> DOWN
                                       --its connection dropped-----------------------> DOWN
    DOWN --heartbeat answered--> UP          (UNKNOWN goes DOWN the same ways)

A heartbeat is a ``hello`` sent every ``heartbeat_interval`` to every endpoint, whatever its
health (a DOWN daemon must be able to come back).

Routing: a request goes to the UP endpoint with the fewest outstanding requests, ties broken
round robin; with no UP endpoint it is parked until one comes up or its deadline passes.

Once-only: a request is *sent to run* at most twice. When the daemon holding it is lost, it is
re-sent once to another; lost again, it fails with POISON, as a request that two dying workers
held does inside a daemon. A reply from either daemon that held it ends it (a daemon marked DOWN
for silence may only have been slow). A refusal that proves the request never ran (OVERLOADED,
SHUTTING_DOWN, NO_WORKER before a worker took it) does not count as a run: the request tries
every other UP endpoint once, and fails with that refusal when all of them have refused.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

RUNS_AT_MOST = 2  # the first send and one re-send after its daemon was lost


class Health(enum.Enum):
    UNKNOWN = "UNKNOWN"  # never answered yet
    UP = "UP"
    DOWN = "DOWN"


class Next(enum.Enum):
    """What becomes of a request an endpoint refused without running it."""

    ROUTE = "ROUTE"  # send it to another endpoint
    WAIT = "WAIT"  # another daemon holds it still
    FAIL = "FAIL"  # every UP endpoint refused it


@dataclass
class EndpointState:
    endpoint: str
    health: Health = Health.UNKNOWN
    outstanding: set[int] = field(default_factory=set)  # ticket keys in flight there
    heartbeat_sent_at: float | None = None  # the unanswered heartbeat, if any
    next_heartbeat_at: float = 0.0


@dataclass(eq=False)
class Ticket:
    """One request as the balancer sees it."""

    key: int
    deadline: float
    runs: int = 0  # sends that may have run it
    held_by: list[str] = field(default_factory=list)  # every endpoint that may still answer it
    refused_by: set[str] = field(default_factory=set)  # endpoints that refused it without running it


class Balancer:
    def __init__(self, endpoints: list[str], clock: Callable[[], float],
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"an endpoint is listed twice: {endpoints}")
        self.clock = clock
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.endpoints = {endpoint: EndpointState(endpoint) for endpoint in endpoints}
        self.tickets: dict[int, Ticket] = {}
        self.parked: list[Ticket] = []  # waiting for an UP endpoint
        self._rotation = 0

    # -- health -----------------------------------------------------------------------------

    def healthy(self) -> list[str]:
        return [state.endpoint for state in self.endpoints.values() if state.health is Health.UP]

    def heartbeats_due(self) -> list[str]:
        """Endpoints to send a heartbeat to now; each is recorded as sent."""
        now = self.clock()
        due = []
        for state in self.endpoints.values():
            if state.heartbeat_sent_at is None and now >= state.next_heartbeat_at:
                state.heartbeat_sent_at = now
                due.append(state.endpoint)
        return due

    def heartbeat_answered(self, endpoint: str) -> bool:
        """True if the endpoint just became UP (the caller then routes the parked requests)."""
        state = self.endpoints[endpoint]
        state.heartbeat_sent_at = None
        state.next_heartbeat_at = self.clock() + self.heartbeat_interval
        if state.health is Health.UP:
            return False
        logger.info("daemon %s answers: %s -> UP", endpoint, state.health.value)
        state.health = Health.UP
        return True

    def silent(self) -> list[str]:
        """Endpoints whose heartbeat went unanswered for heartbeat_timeout; the caller passes
        each to ``lost``. A new heartbeat goes out after the interval."""
        now = self.clock()
        found = []
        for state in self.endpoints.values():
            sent = state.heartbeat_sent_at
            if sent is not None and now - sent >= self.heartbeat_timeout:
                state.heartbeat_sent_at = None
                state.next_heartbeat_at = now
                found.append(state.endpoint)
        return found

    def lost(self, endpoint: str, why: str) -> tuple[list[Ticket], list[Ticket]]:
        """Mark the endpoint DOWN. Returns (to_resend, to_fail): its in-flight requests that no
        other daemon still holds, split by whether they may run once more. Every ticket in
        to_resend must then be passed to ``route``; every ticket in to_fail is finished."""
        state = self.endpoints[endpoint]
        if state.health is not Health.DOWN:
            logger.warning("daemon %s lost (%s): %s -> DOWN, %d request(s) in flight there",
                           endpoint, why, state.health.value, len(state.outstanding))
        state.health = Health.DOWN
        resend, fail = [], []
        for key in sorted(state.outstanding):
            ticket = self.tickets[key]
            ticket.held_by.remove(endpoint)
            if ticket.held_by:
                continue  # the daemon it was re-sent to may still answer
            (resend if ticket.runs < RUNS_AT_MOST else fail).append(ticket)
        state.outstanding.clear()
        for ticket in fail:
            self._forget(ticket)
        return resend, fail

    # -- requests ---------------------------------------------------------------------------

    def add(self, key: int, timeout: float) -> Ticket:
        ticket = Ticket(key, self.clock() + timeout)
        self.tickets[key] = ticket
        return ticket

    def route(self, ticket: Ticket) -> str | None:
        """The endpoint to send the ticket to now (recorded as in flight there), or None: no UP
        endpoint that has not refused it; it is then parked (see ``refused`` for the end of
        the refusals)."""
        endpoint = self._least_outstanding(exclude=ticket.refused_by)
        if endpoint is None:
            if ticket not in self.parked:
                self.parked.append(ticket)
            return None
        if ticket in self.parked:
            self.parked.remove(ticket)
        ticket.runs += 1
        ticket.held_by.append(endpoint)
        self.endpoints[endpoint].outstanding.add(ticket.key)
        return endpoint

    def unpark(self) -> list[Ticket]:
        """The parked tickets, for the caller to route again (after an endpoint came UP)."""
        parked, self.parked = self.parked, []
        return parked

    def refused(self, ticket: Ticket, endpoint: str) -> "Next":
        """The endpoint answered with a refusal that proves it did not run the request. ROUTE:
        another UP endpoint may take it (the caller routes it); WAIT: another daemon still holds
        it; FAIL: every UP endpoint has refused it (the caller fails it with this refusal; the
        ticket is finished)."""
        self._release(ticket, endpoint)
        ticket.runs -= 1
        ticket.refused_by.add(endpoint)
        if ticket.held_by:
            return Next.WAIT
        if not [other for other in self.healthy() if other not in ticket.refused_by]:
            self._forget(ticket)
            return Next.FAIL
        return Next.ROUTE

    def finished(self, ticket: Ticket) -> None:
        """A reply ended the ticket (from any daemon that held it)."""
        for endpoint in list(ticket.held_by):
            self._release(ticket, endpoint)
        self._forget(ticket)

    def expired(self) -> list[Ticket]:
        """Tickets whose deadline has passed, finished here: the caller fails them (Timeout)."""
        now = self.clock()
        late = [ticket for ticket in self.tickets.values() if now >= ticket.deadline]
        for ticket in late:
            self.finished(ticket)
        return late

    def next_wakeup(self) -> float | None:
        """The nearest time something is due: a heartbeat to send or to give up on, a deadline."""
        times = [ticket.deadline for ticket in self.tickets.values()]
        for state in self.endpoints.values():
            if state.heartbeat_sent_at is None:
                times.append(state.next_heartbeat_at)
            else:
                times.append(state.heartbeat_sent_at + self.heartbeat_timeout)
        return min(times) if times else None

    def outstanding(self, endpoint: str) -> int:
        return len(self.endpoints[endpoint].outstanding)

    # -- internals --------------------------------------------------------------------------

    def _least_outstanding(self, exclude: set[str]) -> str | None:
        names = list(self.endpoints)
        # Start the scan one further each time, so that ties (an idle fleet) go round robin.
        self._rotation = (self._rotation + 1) % len(names)
        best: EndpointState | None = None
        for index in range(len(names)):
            state = self.endpoints[names[(self._rotation + index) % len(names)]]
            if state.health is not Health.UP or state.endpoint in exclude:
                continue
            if best is None or len(state.outstanding) < len(best.outstanding):
                best = state
        return best.endpoint if best else None

    def _release(self, ticket: Ticket, endpoint: str) -> None:
        self.endpoints[endpoint].outstanding.discard(ticket.key)
        if endpoint in ticket.held_by:
            ticket.held_by.remove(endpoint)

    def _forget(self, ticket: Ticket) -> None:
        self.tickets.pop(ticket.key, None)
        if ticket in self.parked:
            self.parked.remove(ticket)
