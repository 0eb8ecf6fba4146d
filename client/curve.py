"""A client's CURVE keys for a ``tcp://`` frontend (ZeroMQ RFC 26, CurveZMQ).

A daemon configured with ``[daemon.curve]`` makes every tcp frontend a CURVE server: it answers
only a client that (1) knows the server's public key and (2) holds a key pair whose public half
is in the daemon's ``client_keys`` directory. Both come from ``modelwarden keygen``:

- ``server_key``: the server's public ``.key`` file, or its 40-character z85 public key;
- ``client_key``: the client's ``.key_secret`` file (it holds both halves of the pair).

Arguments win; absent ones come from ``MODELWARDEN_SERVER_KEY`` / ``MODELWARDEN_CLIENT_KEY``
(paths). Only tcp endpoints use them: an ipc endpoint ignores them. Giving one without the other
is an error (ValueError), as is a key file that cannot be read; neither ever reaches the wire.

A wrong or missing key is never answered: libzmq drops the handshake and retries in the
background, so the caller sees its Timeout, whose message hints at the keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import zmq
from zmq.auth.certs import load_certificate
from zmq.utils import z85

from modelwarden.shared.rawconfig import ENV_CLIENT_KEY, ENV_SERVER_KEY

Z85_KEY_LENGTH = 40  # 32 bytes in z85


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes  # z85
    public: bytes  # z85
    secret: bytes = field(repr=False)  # z85


def client_keys(endpoint: str, server_key: str | os.PathLike | None = None,
                client_key: str | os.PathLike | None = None) -> ClientKeys | None:
    """The keys for ``endpoint``: None for ipc, or for tcp when no key is given anywhere."""
    if not endpoint.startswith("tcp://"):
        return None
    server_key = server_key or os.environ.get(ENV_SERVER_KEY) or None
    client_key = client_key or os.environ.get(ENV_CLIENT_KEY) or None
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise ValueError("CURVE needs both keys: server_key (the server's public .key file) and "
                         "client_key (your .key_secret file); set both or neither")
    public, secret = read_key_file(client_key)
    if secret is None:
        raise ValueError(f"client_key {client_key} holds no secret key: pass the .key_secret file")
    return ClientKeys(_server_public(server_key), public, secret)


def make_curve_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Set before connect: the options take effect at the handshake."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret


def _server_public(value: str | os.PathLike) -> bytes:
    text = os.path.expanduser(os.fspath(value))
    if not os.path.exists(text) and len(text) == Z85_KEY_LENGTH:
        try:
            z85.decode(text)
            return text.encode("ascii")
        except (ValueError, KeyError):
            pass  # not a z85 key: report it as the file it is not
    public, _ = read_key_file(text)
    return public


def read_key_file(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """(public, secret or None), both z85; ValueError naming the file if it is unusable."""
    path = os.path.expanduser(path)
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key file {os.fspath(path)}: {exc}") from None
    _check_z85(path, public)
    if secret is not None:
        _check_z85(path, secret)
    return public, secret


def _check_z85(path: str | os.PathLike, key: bytes) -> None:
    try:
        valid = len(key) == Z85_KEY_LENGTH and len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        valid = False
    if not valid:
        raise ValueError(f"CURVE key file {os.fspath(path)} holds a malformed key")
