"""Who may speak on the backend socket: only the worker processes this supervisor spawned.

Contract. Each incarnation gets, at spawn, a random routing identity (16 bytes) and a random
secret (32 bytes), neither derivable from its slot or generation; both travel only in the
WorkerSpec that multiprocessing pickles through the spawn pipe (never argv, never environment).
The worker's first backend message is ``{"type": "hello", "secret": <32 bytes>}``. Until an
identity has presented its own secret, everything it sends is dropped; so is everything from an
identity we did not give out, a wrong secret, and a second hello for an identity already
authenticated. A refusal is logged at WARNING, at most once a minute per identity (an attacker
must not be able to flood the log), and never shows the secret, only the start of the identity.

The file system keeps strangers off the backend socket (it lives in a 0700 directory); this
keeps off a process that can reach it but is not the incarnation we started -- a leftover
worker, a process of the daemon's own user, root running a tool by mistake -- from being sent
client requests or having its results relayed.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from typing import Callable

from modelwarden.shared import protocol

logger = logging.getLogger(__name__)

IDENTITY_BYTES = 16
SECRET_BYTES = 32
WARN_EVERY_S = 60.0
MAX_REMEMBERED = 4096  # identities whose last warning we remember (random ones are unbounded)
HELLO = protocol.HELLO  # the worker's first message (worker.serve.Channel.hello)


def new_credentials() -> tuple[bytes, bytes]:
    """A fresh (routing identity, secret) pair for one incarnation."""
    return secrets.token_bytes(IDENTITY_BYTES), secrets.token_bytes(SECRET_BYTES)


class BackendGate:
    """Decides, per backend message, whether its sender has proved who it is.

    ``admit`` is given the sender's identity, the handle registered under it (or None) and the
    decoded header; it returns True when the message is to be acted on. Handles carry an
    ``authenticated`` flag and a ``spec.secret``.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.refused = 0  # messages dropped since start
        self._last_warned: dict[bytes, float] = {}
        self._suppressed: dict[bytes, int] = {}

    def admit(self, identity: bytes, handle, header: dict | None) -> bool:
        if handle is None:
            self.refuse(identity, "unknown identity")
            return False
        if header is not None and header.get("type") == HELLO:
            self._hello(identity, handle, header.get("secret"))
            return False
        if not handle.authenticated:
            self.refuse(identity, f"{handle.worker_id} has not presented its secret")
            return False
        return True

    def _hello(self, identity: bytes, handle, secret) -> None:
        if handle.authenticated:
            self.refuse(identity, f"{handle.worker_id} is already authenticated (duplicate hello)")
        elif not isinstance(secret, bytes) or not hmac.compare_digest(secret, handle.spec.secret):
            self.refuse(identity, f"wrong secret for {handle.worker_id}")
        else:
            handle.authenticated = True
            logger.info("%s pid %s: authenticated on the backend", handle.worker_id, handle.pid)

    def refuse(self, identity: bytes, reason: str) -> None:
        self.refused += 1
        now = self.clock()
        last = self._last_warned.get(identity)
        if last is not None and now - last < WARN_EVERY_S:
            self._suppressed[identity] = self._suppressed.get(identity, 0) + 1
            return
        if len(self._last_warned) >= MAX_REMEMBERED:
            self._forget_before(now - WARN_EVERY_S)
        suppressed = self._suppressed.pop(identity, 0)
        self._last_warned[identity] = now
        logger.warning("backend: dropping a message from identity %s: %s%s", describe(identity),
                       reason, f" ({suppressed} more dropped in the last minute)" if suppressed else "")

    def _forget_before(self, cutoff: float) -> None:
        for identity, at in list(self._last_warned.items()):
            if at < cutoff:
                del self._last_warned[identity]
                self._suppressed.pop(identity, None)
        if len(self._last_warned) >= MAX_REMEMBERED:  # a flood of fresh identities: start over
            self._last_warned.clear()
            self._suppressed.clear()


def describe(identity: bytes) -> str:
    """An identity for the log: its first bytes in hex (identities are not secret, but long)."""
    return identity[:8].hex() + ("..." if len(identity) > 8 else "")
