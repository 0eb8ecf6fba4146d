"""CURVE on tcp frontends (ZeroMQ RFC 26) and its ZAP handler (RFC 27), inside the one poll loop.

The contract:

- With ``[daemon.curve]``, every ``tcp://`` frontend is a CURVE server holding the key pair of
  ``server_secret_key``: traffic is encrypted and each client proves a key pair. ``ipc://``
  frontends, the control socket and the admin socket stay NULL: file permissions guard them.
- A client is admitted only if its public key is in a ``*.key`` file in ``client_keys``. libzmq
  asks ZAP at every CURVE handshake; ``ZapHandler`` answers on the REP socket that pyzmq's
  ``Authenticator.start()`` binds at ``inproc://zeromq.zap.01`` of the daemon's context. The
  supervisor registers that socket in its poller and calls ``on_request`` when it is readable:
  no thread (pyzmq's ThreadAuthenticator only runs the same handler in one).
- Fail closed. Every CURVE frontend names the ZAP domain ``modelwarden``: libzmq 4.3 does not
  ask ZAP at all for a socket without a domain (it then admits any client key: encryption
  without authentication). It also sets ``ZAP_ENFORCE_DOMAIN``, so a handshake that finds no
  handler is refused rather than admitted; and the handler is bound before any frontend.
- Keys are read at start; an unreadable or malformed key file or directory is a ConfigError
  naming it (exit 2). SIGHUP reads the client keys again (``reload``); a failure then keeps the
  keys in force and logs an ERROR.
- A refused handshake is logged at WARNING once per source address per minute, with the number
  of refusals from it since its last line (shared/lograte.py): neither a client that keeps
  reconnecting nor one with a fresh key for every handshake floods the log. pyzmq's own authenticator log goes to a
  child logger that shows WARNING and above only: its DEBUG lines describe every handshake.
- Not seen here: a client without CURVE (a mechanism mismatch) or with a wrong server key (its
  HELLO does not decrypt) fails in libzmq's handshake before ZAP is asked. It gets no reply,
  and no log line from this module.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zmq
from zmq.auth.base import Authenticator
from zmq.utils import z85

from modelwarden.shared.config import ConfigError, Settings, is_exposed_tcp
from modelwarden.client.curve import read_key_file
from modelwarden.shared.lograte import LineBudget

logger = logging.getLogger(__name__)
_pyzmq_log = logging.getLogger(__name__ + ".pyzmq")
_pyzmq_log.setLevel(logging.WARNING)

REFUSAL_LOG_INTERVAL = 60.0  # seconds between two WARNINGs for the same source address
ZAP_OK = b"200"
ZAP_DRAIN_MAX = 64  # requests answered per poll round; the level-triggered poll comes back for more
ZAP_DOMAIN = "modelwarden"  # libzmq 4.3 asks ZAP only for sockets that name a domain


@dataclass(frozen=True)
class ServerKeys:
    public: bytes  # z85
    secret: bytes = field(repr=False)  # z85


def read_server_keys(settings: Settings) -> ServerKeys | None:
    """The server's key pair, or None without ``[daemon.curve]``; ConfigError naming the file."""
    curve = settings.daemon.curve
    if curve is None:
        return None
    path = settings.resolve(curve.server_secret_key)
    try:
        public, secret = read_key_file(path)
    except ValueError as exc:
        raise ConfigError("daemon.curve.server_secret_key", str(exc)) from None
    if secret is None:
        raise ConfigError("daemon.curve.server_secret_key",
                          f"{path} holds no secret key: name the .key_secret file")
    return ServerKeys(public, secret)


def read_client_keys(directory: Path) -> dict[bytes, str]:
    """Every public key in ``directory/*.key``, in pyzmq's certs format (a true value per key):
    the value is the client's identity, ``key:`` and the file's name without ``.key``
    (supervisor/routing/identity.py); ConfigError naming the directory or the file that cannot be read."""
    key = "daemon.curve.client_keys"
    if not directory.is_dir():
        raise ConfigError(key, f"{directory} is not a directory")
    # glob() would see an unreadable directory as an empty one: every client refused, silently.
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ConfigError(key, f"cannot read {directory}: permission denied")
    paths = sorted(directory.glob("*.key"))
    keys: dict[bytes, str] = {}
    for path in paths:
        try:
            public, _ = read_key_file(path)
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
        keys[public] = f"key:{path.stem}"
    return keys


def check_keys(settings: Settings) -> None:
    """Read every key the configuration names, as the daemon will at start."""
    if settings.daemon.curve is not None:
        read_server_keys(settings)
        read_client_keys(settings.resolve(settings.daemon.curve.client_keys))


def make_curve_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Set before bind: the options apply to every connection the socket accepts."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def warn_plaintext(settings: Settings) -> None:
    """A loud line at every start for each frontend that other hosts reach in plaintext."""
    if settings.daemon.curve is not None:
        return
    for endpoint in settings.frontends:
        if is_exposed_tcp(endpoint):
            logger.warning("PLAINTEXT tcp frontend %s (daemon.allow_plaintext_tcp = true): anyone "
                           "who reaches it can use every model and read every tensor; configure "
                           "[daemon.curve] to authenticate and encrypt it", endpoint)


class RefusalLog(LineBudget):
    """Refused CURVE handshakes, reported per source address (never per key: a client that
    makes a fresh key pair for every handshake is still one source) once per ``interval``."""

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL) -> None:
        super().__init__(interval)


class ZapHandler(Authenticator):
    """pyzmq's Authenticator driven from the supervisor's poll loop; CURVE, domain ``modelwarden``."""

    def __init__(self, context: zmq.Context, client_keys: Path, clock: Callable[[], float]) -> None:
        super().__init__(context, log=_pyzmq_log)
        self.client_keys = client_keys
        self.refusals = RefusalLog()
        self._clock = clock
        self._last_status: bytes | None = None

    def start(self) -> None:
        """Read the allowed keys (ConfigError if they cannot be), then bind the ZAP socket."""
        self.certs[ZAP_DOMAIN] = read_client_keys(self.client_keys)
        super().start()
        logger.info("CURVE: %d client key(s) allowed from %s", len(self.certs[ZAP_DOMAIN]),
                    self.client_keys)

    def reload(self) -> None:
        """Read the client keys again (SIGHUP); keep the old ones if they cannot be read."""
        try:
            keys = read_client_keys(self.client_keys)
        except ConfigError as exc:
            logger.error("CURVE: client keys not reloaded (%s); the %d key(s) read before stay "
                         "allowed", exc, len(self.certs[ZAP_DOMAIN]))
            return
        self.certs[ZAP_DOMAIN] = keys
        logger.info("CURVE: client keys reloaded: %d key(s) allowed now", len(keys))

    def on_request(self) -> None:
        """The ZAP socket is readable: answer every request waiting (a handshake waits on each,
        and libzmq's own wake-up for one that came in while another was answered may be spent)."""
        for _ in range(ZAP_DRAIN_MAX):
            try:
                message = self.zap_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_status = None
            _finish_now(self.handle_zap_message(message))
            if self._last_status != ZAP_OK:
                self._report_refusal(message)

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The admitted client's identity, which libzmq attaches to its every message."""
        return self.certs[ZAP_DOMAIN].get(z85.encode(client_public_key), "key:?")

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous") -> None:
        # Every answer passes here: remember it so on_request knows a refusal from an admission.
        self._last_status = status_code
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    def _report_refusal(self, message: list[bytes]) -> None:
        address = message[3].decode("utf-8", "replace") if len(message) > 3 else "?"
        mechanism = message[5].decode("ascii", "replace") if len(message) > 5 else "?"
        credential = message[6] if len(message) > 6 else b""
        key = z85.encode(credential).decode("ascii") if len(credential) == 32 else "none"
        refused = self.refusals.due(address, self._clock())
        if refused:
            logger.warning("CURVE: refused %s from %s, client key %s (not in %s); %d refusal(s) "
                           "from this address since its last report; next report in %.0fs at "
                           "the earliest", mechanism, address, key, self.client_keys, refused,
                           self.refusals.interval)


def _finish_now(coroutine) -> None:
    """Run pyzmq's ``handle_zap_message`` to its end. It is a coroutine only so that a
    credentials callback may await; we configure none, so it ends at its first step."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("the ZAP handler tried to wait: it must answer in one step")
