"""Which worker messages the supervisor acts on: only those of the incarnation it spawned, once
that incarnation has proved who it is.

Contract. A worker speaks only on its link (shared/link.py): a socket pair whose other end the
supervisor gives that one child at spawn, so there is no address anyone could connect to. On
top of that, each incarnation gets at spawn a random secret (32 bytes), which travels only in the
WorkerSpec that multiprocessing pickles through the spawn pipe (never argv, never environment).
The worker's first message is ``{"type": "hello", "secret": <32 bytes>}``, sent before the
model's code runs; until it has presented its own secret, everything on its link is dropped; so
is a wrong secret and a second hello. So an end of a link that reached another process before the
worker spoke (a leak we did not foresee) still cannot speak for it. A refusal is logged at
WARNING, at most once a minute per worker (a broken one must not flood the log), and never shows
the secret.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from typing import Callable

from modelwarden.shared import protocol

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
WARN_EVERY_S = 60.0
MAX_REMEMBERED = 4096  # workers whose last warning we remember
HELLO = protocol.HELLO  # the worker's first message (worker.serve.SupervisorLink.hello)


def new_secret() -> bytes:
    """A fresh spawn secret for one incarnation."""
    return secrets.token_bytes(SECRET_BYTES)


class WorkerGate:
    """Decides, per message on a worker's link, whether its worker has proved who it is.

    ``admit`` is given the worker's handle (it carries an ``authenticated`` flag and a
    ``spec.secret``) and the decoded header; it returns True when the message is to be acted on.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.refused = 0  # messages dropped since start
        self._last_warned: dict[tuple, float] = {}
        self._suppressed: dict[tuple, int] = {}

    def admit(self, handle, header: dict) -> bool:
        if header.get("type") == HELLO:
            self._hello(handle, header.get("secret"))
            return False
        if not handle.authenticated:
            self.refuse(handle, "it has not presented its secret")
            return False
        return True

    def _hello(self, handle, secret) -> None:
        if handle.authenticated:
            self.refuse(handle, "it is already authenticated (duplicate hello)")
        elif not isinstance(secret, bytes) or not hmac.compare_digest(secret, handle.spec.secret):
            self.refuse(handle, "wrong secret")
        else:
            handle.authenticated = True
            logger.info("%s pid %s: authenticated on its link", handle.worker_id, handle.pid)

    def refuse(self, handle, reason: str) -> None:
        self.refused += 1
        key = (handle.worker_id, handle.pid)
        now = self.clock()
        last = self._last_warned.get(key)
        if last is not None and now - last < WARN_EVERY_S:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        if len(self._last_warned) >= MAX_REMEMBERED:
            self._forget_before(now - WARN_EVERY_S)
        suppressed = self._suppressed.pop(key, 0)
        self._last_warned[key] = now
        logger.warning("%s pid %s: dropping a message on its link: %s%s", handle.worker_id,
                       handle.pid, reason,
                       f" ({suppressed} more dropped in the last minute)" if suppressed else "")

    def _forget_before(self, cutoff: float) -> None:
        for key, at in list(self._last_warned.items()):
            if at < cutoff:
                del self._last_warned[key]
                self._suppressed.pop(key, None)
        if len(self._last_warned) >= MAX_REMEMBERED:  # many workers at once: start over
            self._last_warned.clear()
            self._suppressed.clear()
