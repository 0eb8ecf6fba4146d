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

Only the standard library here (and shared/lograte.py, which is too): the supervisor checks
the files at start (``read_tokens``, ``check_tls``) without importing the gateway's libraries.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from pathlib import Path
from typing import Callable

from modelwarden.shared.lograte import LineBudget

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
RECHECK_S = 1.0  # at most one stat of the file per second, whatever the request rate
REFUSALS_LOGGED_EVERY_S = 60.0
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
CHALLENGE = 'Bearer realm="modelwarden"'  # the WWW-Authenticate of a REST 401


def file_signature(path: Path) -> tuple | None:
    """What changes when the file is replaced, rewritten, chmodded or chowned (ctime); None when
    it cannot be looked at."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size


class SecretFileError(ValueError):
    """The token file (or the TLS key) cannot be used: why, and which file."""


def read_tokens(path: Path) -> list[bytes]:
    """The SHA-256 digests of the tokens in ``path``; SecretFileError says what is wrong."""
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            _check_owner_and_mode(path, info)
            text = file.read(1024 * 1024 + 1)
    except OSError as exc:
        raise SecretFileError(f"token_file {path}: {exc.strerror or exc}") from None
    if len(text) > 1024 * 1024:
        raise SecretFileError(f"token_file {path}: larger than 1 MiB")
    digests = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        if len(line) < MIN_TOKEN_CHARS or not all(0x21 <= byte < 0x7F for byte in line):
            raise SecretFileError(f"token_file {path}, line {number}: a token is at least "
                                 f"{MIN_TOKEN_CHARS} printable ASCII characters without spaces "
                                 "(modelwarden token FILE makes one)")
        digests.append(hashlib.sha256(line).digest())
    if not digests:
        raise SecretFileError(f"token_file {path} holds no token (modelwarden token FILE adds one)")
    return digests


def _check_owner_and_mode(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise SecretFileError(f"token_file {path} is not a regular file")
    if info.st_uid not in (os.geteuid(), 0):
        raise SecretFileError(f"token_file {path} is owned by uid {info.st_uid}: it must belong to "
                             "the daemon's user or root, or whoever owns it can grant access")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o027:
        raise SecretFileError(f"token_file {path} has mode {mode:04o}: other users may read it or "
                             "its group may change it; chmod 600 (or 640)")


def check_tls(cert: Path, key: Path, client_ca: Path | None = None) -> None:
    """The certificate chain and its key load and belong together; the key is kept private; the
    client CA, if any, loads."""
    import ssl

    try:
        with open(key, "rb") as file:
            info = os.fstat(file.fileno())
    except OSError as exc:
        raise SecretFileError(f"tls_key {key}: {exc.strerror or exc}") from None
    try:
        _check_owner_and_mode(key, info)
    except SecretFileError as exc:
        raise SecretFileError(str(exc).replace("token_file", "tls_key", 1)) from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError is one: a bad PEM, or a key of another certificate
        raise SecretFileError(f"tls_cert {cert} with tls_key {key}: {exc.strerror or exc}") from None
    if client_ca is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=client_ca)
        except OSError as exc:
            raise SecretFileError(f"tls_client_ca {client_ca}: {exc.strerror or exc}") from None


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
