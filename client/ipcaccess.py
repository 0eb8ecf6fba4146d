"""Can this process reach an ``ipc://`` endpoint? Asked before connecting, answered at once.

A ZeroMQ connect on ``ipc://`` never reports EACCES: libzmq retries in the background and the
caller only ever sees a timeout. The daemon's access control is the file system (see
docs/ARCHITECTURE.md, "Trust boundary"), so the file system is also where a client learns it
is on the wrong side of it: the socket file must be writable and every directory above it
searchable.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from modelwarden.shared.errors import NoDaemon


def check_ipc_endpoint(endpoint: str, require_present: bool = False) -> None:
    """Raise PermissionError when this process may not connect to ``endpoint`` (an ipc path that
    exists but that we cannot reach), NoDaemon when ``require_present`` and nothing is there.
    tcp endpoints, and paths that may still appear (the daemon starting), pass. A ``unix://``
    endpoint (the local frontend) is a socket file too, and checked the same way."""
    if not endpoint.startswith(("ipc://", "unix://")):
        return
    path = Path(endpoint.partition("://")[2])
    if os.access(path, os.W_OK, effective_ids=True):
        stale = stale_socket(path)
        if stale is not None:
            raise NoDaemon(stale)
        return
    blocker = _blocking_dir(path)
    if blocker is None:
        try:
            os.stat(path)
        except FileNotFoundError:
            if require_present:
                raise NoDaemon(f"no daemon at {path}: the socket file does not exist "
                               "(is the daemon running? is this its runtime directory?)") from None
            return
        blocker = path
    raise PermissionError(f"permission denied: {path} ({who_may(blocker)})")


PID_FILE = "modelwarden.pid"  # supervisor/runtime.py: the daemon holds an flock on it while it runs


def stale_socket(path: Path) -> str | None:
    """Why nobody answers at ``path``, when the runtime directory's pid file says no daemon
    holds it: a socket left by a daemon that stopped. None when a daemon holds it, when there
    is no pid file beside the socket (or one level up, for ``private/``), or when we cannot tell.
    Both must say so: no lock on the pid file in /proc/locks (looking must not take the lock a
    starting daemon needs) and no process with the pid it names. The pid file is 0600 (only the
    daemon's user may open it, so only it may lock it): to a member of ``shm_group`` the lock
    alone says so. Any doubt answers None, and the caller waits for a reply as before."""
    for runtime in (path.parent, path.parent.parent):
        pid_file = runtime / PID_FILE
        try:
            info = os.stat(pid_file)
        except OSError:
            continue
        if _flock_held(info) is not False:
            return None
        if not os.access(pid_file, os.R_OK, effective_ids=True):
            return f"no daemon runs for {runtime} (stale socket: nobody holds its pid file's lock)"
        pid = _pid_in(pid_file)
        if pid is None or _alive(pid):
            return None
        return f"no daemon runs for {runtime} (stale socket from pid {pid})"
    return None


def _flock_held(info: os.stat_result) -> bool | None:
    """Whether any process holds a lock on the file ``info`` describes; None if unknowable."""
    # By inode alone: overlay file systems show another device number there than stat does,
    # and a false "held" only means falling back to waiting for a reply.
    inode = f":{info.st_ino}"
    try:
        with open("/proc/locks") as locks:
            return any(field.endswith(inode) for line in locks for field in line.split()[5:6])
    except OSError:
        return None


def _pid_in(pid_file: Path) -> int | None:
    try:
        text = pid_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _blocking_dir(path: Path) -> Path | None:
    """The first directory above ``path`` we may not search, if any."""
    for directory in reversed(path.parents):
        if directory.exists() and not os.access(directory, os.X_OK, effective_ids=True):
            return directory
    return None


def who_may(path: Path) -> str:
    """Who the file system lets through ``path``: its owner, root, and its group when the group
    has the permission that matters (search on a directory, write on a socket)."""
    try:
        info = os.stat(path)
    except OSError:
        return "the daemon's user or root"
    owner = _name(pwd.getpwuid, info.st_uid, "pw_name")
    group_bit = stat.S_IXGRP if stat.S_ISDIR(info.st_mode) else stat.S_IWGRP
    if info.st_mode & group_bit:
        group = _name(grp.getgrgid, info.st_gid, "gr_name")
        return f"the daemon's user ({owner}), root, or a member of group {group}"
    return f"only the daemon's user ({owner}) or root"


def _name(lookup, number: int, attribute: str) -> str:
    try:
        return getattr(lookup(number), attribute)
    except KeyError:
        return str(number)
