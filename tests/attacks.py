"""A hostile member of the clients' group, written from docs/PROTOCOL.md with nothing but the
standard library (as an attacker in any language would be). Run by tests/test_attacks.py as an
unprivileged user under the system python:

    python3 tests/attacks.py connect PATH COUNT          open COUNT unix connections to PATH
    python3 tests/attacks.py channels PATH COUNT         open COUNT buffers.sock connections
    python3 tests/attacks.py streams PATH COUNT          the same, on a stream socket (unix://)
    python3 tests/attacks.py register PATH PER MESSAGES SIZE [sparse]
                                                         MESSAGES registrations of PER copies of
                                                         one SIZE-byte memfd (sparse: never written)

Each prints one JSON line saying what it got, then holds everything open until its standard input
closes, then prints ``done``. Every flood is bounded by its COUNT; makes no judgement.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import select
import socket
import struct
import sys
import time

REGISTER = b"\x82\xa4type\xa8register\xa2id\x01"  # msgpack {"type": "register", "id": 1}
SETTLE_S, MOST_S = 1.0, 20.0  # how long the attacker watches for the daemon's answer
FLOOD_S = 10.0  # the longest a connection flood goes on


def connect(path: str, count: int) -> None:
    """Keep connecting until ``count`` connections are held or FLOOD_S has passed (a full
    backlog, EAGAIN, is tried again: the daemon's I/O thread empties it)."""
    held, refused = [], {}
    deadline = time.monotonic() + FLOOD_S
    while len(held) < count and time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        result = sock.connect_ex(path)
        if result in (0, errno.EINPROGRESS):
            held.append(sock)
            continue
        sock.close()
        name = errno.errorcode.get(result, str(result))
        refused[name] = refused.get(name, 0) + 1
        select.poll().poll(1)  # the backlog is full, or the name is gone: a moment
    closed = _closed_by_peer(held)
    report({"connected": len(held), "refused": refused, "closed_by_daemon": closed})
    hold(held)


def channels(path: str, count: int, kind: int = socket.SOCK_SEQPACKET) -> None:
    held, refused = [], 0
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, kind)
        # A blocking connect waits while the listen backlog is full: every connection reaches the
        # daemon's accept (its share decides), not just those a busy daemon happened to keep up
        # with. SO_SNDTIMEO bounds that wait; settimeout() would not do: it makes the socket
        # non-blocking, and a unix connect to a full backlog then fails EAGAIN at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 2, 0))
        try:
            sock.connect(path)
        except OSError:
            refused += 1
            sock.close()
            continue
        sock.setblocking(False)
        held.append(sock)
    closed = _closed_by_peer(held)
    report({"connected": len(held), "refused": refused, "closed_by_daemon": closed})
    hold(held)


def register(path: str, per_message: int, messages: int, size: int, sparse: bool) -> None:
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if not sparse:
        os.pwrite(fd, b"\1" * min(size, 1 << 20), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(15)
    sock.connect(path)
    tokens, codes, messages_seen = 0, {}, []
    for _ in range(messages):
        try:
            socket.send_fds(sock, [REGISTER], [fd] * per_message)
            reply = sock.recv(1 << 20)
        except OSError as exc:
            codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
            break
        if not reply:
            codes["closed"] = codes.get("closed", 0) + 1
            break
        found = re.findall(rb"[0-9a-f]{32}", reply)
        tokens += len(found)
        if not found:
            code = re.search(rb"(OVERLOADED|BAD_REQUEST|INTERNAL)", reply)
            name = code.group().decode() if code else "?"
            codes[name] = codes.get(name, 0) + 1
            text = re.search(rb"message.([ -~]+)", reply)
            text = text.group(1).decode() if text else repr(reply[:80])
            if text not in messages_seen and len(messages_seen) < 4:
                messages_seen.append(text)
    report({"tokens": tokens, "codes": codes, "messages": messages_seen})
    hold([sock])


def _closed_by_peer(socks: list) -> int:
    """How many of ``socks`` the daemon closed or shut, once that count has settled."""
    closed: set = set()
    by_fd = {sock.fileno(): sock for sock in socks}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    start = last_change = time.monotonic()
    while time.monotonic() - last_change < SETTLE_S and time.monotonic() - start < MOST_S:
        for fd, _ in poller.poll(200):
            sock = by_fd[fd]
            try:
                data = sock.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                closed.add(fd)
                poller.unregister(fd)
                last_change = time.monotonic()
    return len(closed)


def report(found: dict) -> None:
    print(json.dumps(found), flush=True)


def hold(socks: list) -> None:
    sys.stdin.read()  # until the test closes our standard input
    for sock in socks:
        sock.close()
    print("done", flush=True)


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "connect":
        connect(args[0], int(args[1]))
    elif command == "channels":
        channels(args[0], int(args[1]))
    elif command == "streams":
        channels(args[0], int(args[1]), socket.SOCK_STREAM)
    elif command == "register":
        register(args[0], int(args[1]), int(args[2]), int(args[3]), args[4:] == ["sparse"])
    else:
        raise SystemExit(f"unknown attack {command!r}")


if __name__ == "__main__":
    main()
