"""Which client connection may reference which shared-memory segment.

The lessons of Triton's CVE-2024-0088 and CVE-2025-23319/23320/23334, where a client could name
any shared-memory region and any offset:
  * a descriptor may only reference a segment registered on the *same* connection;
  * a segment belongs to the client that registered it first: another connection may register
    it too only by presenting that client's secret session key (a client's threads each have a
    connection; a stranger has neither the 128-bit name nor the key);
  * names must be client segment names (``mw.<pid>.<start>.<hex>``), never a path, never one
    whose creator is this daemon or one of its workers;
  * offset and length are checked against the registered size, in Python ints (no overflow),
    before any worker maps anything; the worker checks the file's real size again;
  * errors never echo a segment name.
The supervisor itself never maps a segment: it only stats it at registration.
"""

from __future__ import annotations

from typing import Callable

from modelwarden.shared import shm
from modelwarden.shared.protocol import (BAD_REQUEST, SEGMENT_NOT_REGISTERED, ProtocolError, bad,
                             segment_owner)

MAX_SEGMENTS_PER_CONNECTION = 4096

Connection = tuple[int, bytes]  # (frontend socket index, routing id)


class SegmentRegistry:
    def __init__(self, own_pids: Callable[[], set[int]]) -> None:
        self._own_pids = own_pids
        self._by_connection: dict[Connection, dict[str, int]] = {}
        self._owner: dict[str, object] = {}  # segment -> session key of the client owning it
        self._users: dict[str, set[Connection]] = {}

    def register(self, connection: Connection, items: list[tuple[str, int]],
                 session: str | None = None) -> None:
        """All or nothing: either every segment is registered, or none and ProtocolError.
        Without a session key the connection itself is the key."""
        key = session if session is not None else connection
        mine = self._by_connection.get(connection, {})
        new = {name for name, _ in items if name not in mine}
        if len(mine) + len(new) > MAX_SEGMENTS_PER_CONNECTION:
            raise bad(f"a connection may register at most {MAX_SEGMENTS_PER_CONNECTION} segments")
        for index, (name, size) in enumerate(items):
            self._check_registrable(key, name, size, f"segment {index}")
        mine = self._by_connection.setdefault(connection, {})
        for name, size in items:
            mine[name] = size
            self._owner[name] = key
            self._users.setdefault(name, set()).add(connection)

    def _check_registrable(self, key: object, name: str, size: int, what: str) -> None:
        owner = self._owner.get(name)
        if owner is not None and owner != key:
            raise bad(f"{what}: segment belongs to another client")
        pid, _ = segment_owner(name)
        if pid in self._own_pids():
            raise bad(f"{what}: segment belongs to the daemon, not to a client")
        if not shm.owner_alive(name):
            raise bad(f"{what}: segment's creator is not running")
        actual = shm.segment_size(name)
        if actual is None:
            raise bad(f"{what}: segment does not exist or is not a regular shared-memory object")
        if size == 0 or size > actual:
            raise bad(f"{what}: registered size must be between 1 and the segment's real size")

    def unregister(self, connection: Connection, names: list[str]) -> list[str]:
        """Names no connection uses any more (workers may unmap them)."""
        mine = self._by_connection.get(connection, {})
        released = []
        for name in names:
            if mine.pop(name, None) is None:
                continue
            users = self._users.get(name, set())
            users.discard(connection)
            if not users:
                self._users.pop(name, None)
                self._owner.pop(name, None)
                released.append(name)
        if not mine:
            self._by_connection.pop(connection, None)
        return released

    def check(self, connection: Connection, region: tuple[str, int, int], what: str) -> None:
        name, offset, nbytes = region
        size = self._by_connection.get(connection, {}).get(name)
        if size is None:
            raise ProtocolError(BAD_REQUEST, f"{what}: segment is not registered on this connection",
                                SEGMENT_NOT_REGISTERED)
        if offset > size or nbytes > size - offset:
            raise bad(f"{what}: region [offset {offset}, +{nbytes}) lies outside the segment's "
                      f"{size} registered bytes")

    def forget(self, names: list[str]) -> None:
        """Drop segments that no longer exist (their creator died and the sweeper took them)."""
        for name in names:
            self._owner.pop(name, None)
            for connection in self._users.pop(name, set()):
                mine = self._by_connection.get(connection, {})
                mine.pop(name, None)
                if not mine:
                    self._by_connection.pop(connection, None)

    def dead_registrations(self) -> list[str]:
        """Registered segments whose file is gone (unlinked by their client without telling us)."""
        return [name for name in self._owner if shm.segment_size(name) is None]

    def __len__(self) -> int:
        return len(self._owner)

