"""One round of the supervisor's poll loop: wait until something is ready or the nearest timer is
due, run the handler of each ready socket or descriptor, close the round, then fire the timers
now due.

The Arbiter owns the loop's policy: what is watched (``watch``/``unwatch``), how a round closes
(``turn(after_round)``: the router dispatching what this round's results freed), and when the
loop ends. This module is only the round itself, which runs about once per request at load, so
it is compiled with the request path (modelwarden/compiled_modules.py) rather than interpreted
as four calls a round. The poller is level-triggered (shared/sockets.Poller): a handler that
leaves messages unread sees them again next round.

A handler's bug must not take the daemon down: it is logged and the round goes on.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

logger = logging.getLogger("modelwarden.supervisor.arbiter")  # where these errors always went


class EventLoop:
    def __init__(self, poller, timers, clock: Callable[[], float]) -> None:
        self.poller = poller
        self.timers = timers
        self.clock = clock
        self.handlers: dict = {}

    def watch(self, item, handler: Callable[[], None], quiet: bool = False) -> None:
        """``quiet``: a zmq socket only its handler reads or writes (shared/sockets.Poller)."""
        self.poller.register(item, quiet)
        self.handlers[item] = handler

    def unwatch(self, item) -> None:
        self.poller.unregister(item)
        self.handlers.pop(item, None)

    def turn(self, after_round: Callable[[], None]) -> None:
        """One round; ``after_round`` runs once every ready handler has."""
        due = self.timers.next_due()
        timeout = None if due is None else max(0, math.ceil((due - self.clock()) * 1000))
        handlers = self.handlers
        for item in self.poller.poll(timeout):
            handler = handlers.get(item)
            if handler is not None:  # unwatched by an earlier handler of this round
                guarded(handler)
        guarded(after_round)
        self.timers.run_due(self.clock())


def guarded(handler: Callable[[], None]) -> None:
    try:
        handler()
    except Exception:
        logger.exception("unexpected error in %s", getattr(handler, "__name__", handler))
