"""Who may call the gateway: bearer tokens listed in a file (``[gateway] token_file``).

The file holds one token per line; blank lines and lines starting with ``#`` are skipped. A
token is at least ``MIN_TOKEN_CHARS`` printable characters without spaces (``modelwarden token
FILE`` appends a random one). A caller presents one as ``Authorization: Bearer TOKEN`` over REST,
or as the gRPC metadata ``authorization: Bearer TOKEN``. Only the health checks answer without
one (``OPEN_PATHS``, ``OPEN_METHODS``): what Kubernetes probes and load balancers call, and all
they learn is whether the server is live and ready.

The file must be a regular file owned by the daemon's user or root, and neither writable by its
group nor open to other users at all (0600, 0640, 0400, 0440): a file someone else can change
can grant access, and one everybody can read has leaked.

The file is the truth at every moment: the gateway looks at it (one ``stat``) at most once every
``RECHECK_S`` and re-reads it when it changed, so tokens are added and revoked without a
restart. A file that can no longer be read, whose mode or owner became wrong, or that holds no
token allows nobody until it is fixed (logged at ERROR): a lost or leaked list must not keep
opening the door.

Tokens are kept as SHA-256 digests, and a presented token's digest is compared with every one of
them by ``hmac.compare_digest``: how long a refusal takes says nothing about how close a guess
was, nor which token it was near.

``check_tls`` holds the TLS key to the same rules and checks that it matches its certificate;
``TlsFiles`` keeps a listener's certificate, key and client CA current the same way.

Only the standard library here (and shared/): the rules for the files themselves are
shared/secretfiles.py, which the supervisor also checks at start without importing the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from pathlib import Path
from typing import Callable

from modelwarden.shared.lograte import LineBudget
from modelwarden.shared.secretfiles import (  # noqa: F401  (the gateway's names for them)
    MIN_TOKEN_CHARS, SecretFileError, check_tls, file_signature, read_tokens)

logger = logging.getLogger(__name__)

RECHECK_S = 1.0  # at most one stat of the file per second, whatever the request rate
REFUSALS_LOGGED_EVERY_S = 60.0
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
CHALLENGE = 'Bearer realm="modelwarden"'  # the WWW-Authenticate of a REST 401


class TlsFiles:
    """The TLS certificate, key and client CA as they are now, for one listener: looked at (one
    ``stat`` each) at most once every ``RECHECK_S`` and loaded again when one changed, so a
    renewed certificate or CA takes effect on the next connection, with no restart. A set that
    does not load (a key written before its certificate, a wrong mode) leaves the previous one in
    use, logged at ERROR; unlike a token list, an old certificate grants nobody anything.

    ``context`` is an ``ssl.SSLContext`` (REST), ``pem`` the files' bytes (gRPC)."""

    def __init__(self, cert: Path, key: Path, client_ca: Path | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import threading

        self.paths = (cert, key, client_ca)
        self.clock = clock
        self._lock = threading.Lock()  # grpc asks from its own threads
        self._signature = self._look()
        self._load()
        self._checked_at = clock()

    def refresh(self) -> bool:
        """Load the files again if they changed since the last look; True when a new set is in."""
        with self._lock:
            now = self.clock()
            if now - self._checked_at < RECHECK_S:
                return False
            self._checked_at = now
            signature = self._look()
            if signature == self._signature:
                return False
            self._signature = signature
            try:
                self._load()
            except (SecretFileError, OSError) as exc:  # ssl.SSLError is an OSError
                logger.error("%s: the gateway keeps its previous TLS certificate", exc)
                return False
            logger.info("TLS files re-read: %s", ", ".join(str(p) for p in self.paths if p))
            return True

    def _load(self) -> None:
        import ssl

        cert, key, authority = self.paths
        check_tls(cert, key, authority)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        if authority is not None:
            context.load_verify_locations(cafile=authority)
            context.verify_mode = ssl.CERT_REQUIRED
        self.pem = (key.read_bytes(), cert.read_bytes(),
                    authority.read_bytes() if authority is not None else None)
        self.context = context

    def _look(self) -> tuple:
        return tuple(file_signature(path) if path is not None else None for path in self.paths)


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    try:
        return token.strip().encode("ascii")
    except UnicodeEncodeError:
        return None


def token_id(digest: bytes) -> str:
    """How logs, errors and quotas name a token: the start of its SHA-256 digest, which says
    nothing of the token itself."""
    return "token:" + digest.hex()[:8]


def identity(token_name: str | None, client_subject: str | None, peer: str) -> str:
    """Who a call counts as (gateway/quota.py): its token, else its client certificate, else
    where it comes from."""
    if token_name:
        return token_name
    if client_subject:
        return f"cert:{client_subject[:128]}"
    return peer


class RefusalLog:
    """One WARNING a minute at most per source (a peer's address, a uid), however many calls or
    keys it tries: a flood from one place costs the journal one line a minute, and the line
    says where it came from and how many it was (shared/lograte.py keeps the count)."""

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # "call(s) refused without a valid token"
        self.clock = clock
        self._lines = LineBudget(REFUSALS_LOGGED_EVERY_S)

    def refused(self, source: str, detail: str = "") -> None:
        count = self._lines.due(source, self.clock())
        if count:
            logger.warning("gateway: %d %s from %s in the last minute%s", count, self.what,
                           source, detail)


class Gatekeeper:
    """Answers "may this caller in, and as which token?" from the token file as it is now
    (re-read when it changes)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self._signature = file_signature(self.path)
        self._digests = read_tokens(path)  # at start a bad file is the caller's error to report
        self._checked_at = clock()
        self.refusals = RefusalLog("call(s) refused without a valid token", clock)

    def admits(self, authorization: str | None, source: str = "unknown") -> str | None:
        """The token's name (``token_id``) when ``authorization`` carries a valid one, else None
        (and the refusal is counted against ``source``)."""
        self._refresh()
        token = bearer_token(authorization)
        allowed = False
        if token is not None:
            digest = hashlib.sha256(token).digest()
            for known in self._digests:  # every one, whatever matched: constant work per call
                allowed |= hmac.compare_digest(known, digest)
        if not allowed:
            self.refusals.refused(source)
            return None
        return token_id(digest)

    def allows(self, authorization: str | None, source: str = "unknown") -> bool:
        return self.admits(authorization, source) is not None

    def _refresh(self) -> None:
        now = self.clock()
        if now - self._checked_at < RECHECK_S:
            return
        self._checked_at = now
        signature = file_signature(self.path)
        if signature == self._signature:
            return
        self._signature = signature
        try:
            self._digests = read_tokens(self.path)
        except SecretFileError as exc:
            self._digests = []
            logger.error("%s: the gateway allows nobody until it is fixed", exc)
            return
        logger.info("token_file %s re-read: %d token(s)", self.path, len(self._digests))
