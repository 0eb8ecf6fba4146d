"""Who a peer is, as the kernel or the CURVE handshake says, never as the peer says.

* A peer on a Unix socket is ``uid:N``. On ``buffers.sock`` and any socket the loop accepts
  itself, that is ``SO_PEERCRED``. On a ZeroMQ ``ipc://`` endpoint libzmq asks the same
  ``SO_PEERCRED`` when it accepts, and puts the answer in every message's ``Peer-Address``
  property as ``HOST:UID:GID:PID`` (libzmq ``src/stream_engine_base.cpp``, ``get_peer_address``);
  the connection itself is known by the descriptor in the monitor's ``ACCEPTED`` event.
* A CURVE client on tcp is ``key:NAME``, the name of its public key's file in ``client_keys``:
  the ZAP handler (supervisor/auth.py) returns it as the ZAP User-Id, and libzmq attaches it to
  every message of that connection as the ``User-Id`` property.
* A plaintext tcp peer is ``addr:IP`` (the port changes with every connection). Connections on
  a CURVE listener are counted by address too: a key is known only once the handshake is done.

Reading a message property costs about 1.3 us; the parsed identity is cached by its raw string.
"""

from __future__ import annotations

import socket
import struct

_UCRED = struct.Struct("3i")
_PARSED: dict[tuple, str] = {}
_PARSED_MAX = 65536  # distinct raw peer addresses remembered (pids change; the cache is dropped)
UNKNOWN = "unknown"


def uid_identity(uid: int) -> str:
    return f"uid:{uid}"


def of_unix_socket(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of a connected Unix socket."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def of_descriptor(fd: int) -> str:
    """The identity of the peer of a connected socket we hold by descriptor only (libzmq's)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return UNKNOWN
    try:
        if sock.family == socket.AF_UNIX:
            return uid_identity(of_unix_socket(sock)[1])
        return f"addr:{sock.getpeername()[0]}"
    except OSError:  # gone already: its DISCONNECTED event follows
        return UNKNOWN
    finally:
        sock.detach()  # the descriptor is libzmq's: never close it here


IPC, TCP, CURVE = "ipc", "tcp", "curve"  # how a frontend's peers are known


def transport_of(endpoint: str, curve: bool) -> str:
    if endpoint.startswith(("ipc://", "unix://")):  # unix://: the loop's own, SO_PEERCRED
        return IPC
    return CURVE if curve else TCP


def property_of(transport: str) -> str:
    """The message property libzmq attaches that says who sent it: the CURVE key's ZAP user id,
    or the peer's address (HOST:UID:GID:PID on ipc://)."""
    return "User-Id" if transport == CURVE else "Peer-Address"


def of_property(raw: str, transport: str) -> str:
    """The identity of a message's sender, from its property ``property_of(transport)`` as
    shared/sockets.recv_routed returns it ("" when the message had none)."""
    if not raw:
        return UNKNOWN
    key = (transport, raw)
    identity = _PARSED.get(key)
    if identity is None:
        identity = _parse(raw, transport)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[key] = identity
    return identity


def _parse(raw: str, transport: str) -> str:
    if transport == CURVE:
        return raw if raw.startswith("key:") else UNKNOWN
    if transport == IPC:
        parts = raw.rsplit(":", 3)  # HOST:UID:GID:PID
        if len(parts) == 4 and parts[1].isascii() and parts[1].isdigit():
            return uid_identity(int(parts[1]))
        return UNKNOWN
    return f"addr:{raw}" if raw else UNKNOWN
