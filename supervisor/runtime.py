"""The runtime directory: sockets live there, and a locked pid file says whose it is.

Layout (docs/ARCHITECTURE.md, "Trust boundary"):

    RUNTIME/               0700, or 0750 group-owned by ``shm_group``: clients may enter
      frontend.sock        0600, or 0660 group-owned: requests over ZeroMQ (the default ipc://)
      local.sock           0600, or 0660 group-owned: requests over the local frontend (the
                           default unix://; a client with no configuration tries it first)
      control.sock         0600, or 0660 group-owned: read-only commands (status)
      modelwarden.pid      0600, the lock: only the daemon's user can open it, so only it can lock it
      private/             0700 always: only the daemon's user (and root) may enter
        admin.sock         commands that change things (stop, restart)

Workers have no socket here: each is reached on a socket pair made when it is spawned
(shared/link.py), which has no path at all.

Checked, never repaired. A directory that is absent is created with exactly the mode above. One
that exists is accepted only if it is a real directory (not a symlink), owned by our euid, with
exactly that mode (and group): anything else is somebody else's doing -- another user who
pre-created ``/tmp/modelwarden-UID``, a symlink to a directory we happen to own, a mode someone
widened -- and the daemon refuses to start, saying which path and what is wrong. It never
chmods or chowns something it did not just create.

Binding an ``ipc://`` endpoint replaces any socket file already at that path, so a second daemon
on the same directory would silently steal the first one's clients: the lock prevents that. A
path that exists and is not a socket is never bound over.
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import stat
from pathlib import Path
from typing import IO

from modelwarden.shared.process import DaemonError, group_id
from modelwarden.shared.rawconfig import LOCAL_SOCKET

PRIVATE_MODE = 0o700
SHARED_MODE = 0o750  # group may enter (and list); only we may create or remove entries
PID_FILE = "modelwarden.pid"
PID_FILE_MODE = 0o600  # only the daemon's user may open it, so only it may lock it


def claim_runtime_dir(runtime: Path, group: str | None) -> IO:
    """Create or check the runtime directory, lock its pid file and write our pid.
    The returned file holds the lock until it is closed (or the process dies)."""
    gid = group_id(group) if group else None
    ensure_dir(runtime, SHARED_MODE if group else PRIVATE_MODE, gid)
    lock = _open_pid_file(runtime / PID_FILE)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        other = lock.read().strip() or "?"
        lock.close()
        raise DaemonError(f"another modelwarden daemon (pid {other}) uses {runtime}") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _open_pid_file(path: Path) -> IO:
    """The pid file, 0600 and ours. Anyone who can open a file can flock it: a 0644 pid file in
    the group's 0750 directory let a member hold a shared lock and keep the daemon from starting
    again. One left 0644 (or widened) is set back to 0600 through the descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PID_FILE_MODE)
    except OSError as exc:
        raise DaemonError(f"cannot open the pid file in {path.parent}: {exc}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by {_user(info.st_uid)}, not by us ({_user(os.geteuid())})"
    elif stat.S_IMODE(info.st_mode) != PID_FILE_MODE:
        os.fchmod(fd, PID_FILE_MODE)
    if problem:
        os.close(fd)
        raise DaemonError(f"pid file {path}: {problem}; refusing to use it")
    return os.fdopen(fd, "r+")


def sweep_unserved_local(runtime: Path, frontends: list[str]) -> None:
    """Remove ``RUNTIME/local.sock`` when this daemon serves no frontend there: a daemon that
    died left it (a clean stop removes its own), and a client with no configuration tries it
    before ``frontend.sock`` and would find nobody. Called under the runtime lock, so no live
    daemon owns it; only a socket is removed, never another kind of file."""
    path = runtime / LOCAL_SOCKET
    if f"unix://{path}" in frontends:
        return
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(info.st_mode):
        path.unlink(missing_ok=True)


def claim_private_dir(path: Path) -> None:
    """``RUNTIME/private``: 0700 and ours, whatever ``shm_group`` says."""
    ensure_dir(path, PRIVATE_MODE, None)


def ensure_dir(path: Path, mode: int, gid: int | None) -> None:
    """Create ``path`` with ``mode`` (and group ``gid``) if absent, else check it is exactly that."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        _create_dir(path, mode, gid)
        return
    except OSError as exc:
        raise DaemonError(f"runtime directory {path}: {exc.strerror}") from None
    problem = dir_problem(info, mode, gid)
    if problem:
        raise DaemonError(f"runtime directory {path}: {problem}; refusing to use it "
                          "(remove it, or fix it by hand, and start again)")


def dir_problem(info: os.stat_result, mode: int, gid: int | None) -> str | None:
    """What makes an existing directory unacceptable, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by {_user(info.st_uid)}, not by us ({_user(os.geteuid())})"
    if stat.S_IMODE(info.st_mode) != mode:
        return f"has mode {stat.S_IMODE(info.st_mode):04o}, expected {mode:04o}"
    if gid is not None and info.st_gid != gid:
        return f"belongs to group {_group(info.st_gid)}, expected {_group(gid)} (daemon.shm_group)"
    return None


def _create_dir(path: Path, mode: int, gid: int | None) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, mode)
        # The umask may have taken bits off: set the mode (and group) on what we just made,
        # through a descriptor, so a path swapped meanwhile is refused rather than changed.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, mode)
            if gid is not None:
                os.fchown(fd, -1, gid)
        finally:
            os.close(fd)
    except OSError as exc:
        raise DaemonError(f"cannot create runtime directory {path}: {exc}") from None


def check_private_endpoint(path: Path) -> None:
    """A configured admin socket must lie in a directory only our user can enter."""
    directory = path.parent
    try:
        info = os.lstat(directory)
    except OSError as exc:
        raise DaemonError(f"{path}: its directory {directory}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is a symbolic link" if stat.S_ISLNK(info.st_mode) else "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by {_user(info.st_uid)}, not by us ({_user(os.geteuid())})"
    elif stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}: others than its owner may enter it"
    else:
        return
    raise DaemonError(f"{path} must lie in a directory only the daemon's user can enter, but "
                      f"{directory} {problem}")


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
