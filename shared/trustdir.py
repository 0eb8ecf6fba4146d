"""Whether a client may use a runtime directory it did not configure.

With no MODELWARDEN_CONFIG, MODELWARDEN_ENDPOINT, ``--config`` or explicit endpoint, a client
looks for the daemon where the daemon would put itself (shared/rawconfig.py,
``client_runtime_dir``): ``$XDG_RUNTIME_DIR/modelwarden``, ``/tmp/modelwarden-UID`` or
``/run/modelwarden``. ``/tmp`` is anyone's: another local user may have made that directory
first, with sockets of their own, to be sent our tensors and handed our shared memory. So before
a client connects there, sends anything or hands over a descriptor, it checks what
supervisor/runtime.py makes:

* the directory: a real directory (not a symbolic link), mode 0700 or 0750, owned by this user,
  by root, or -- when its parent belongs to root and only root may write there (``/run``) -- by
  whoever root made it for (systemd's ``RuntimeDirectory=`` for the ``modelwarden`` user);
  ``private/`` below it likewise, mode 0700;
* each socket it will use there: a real socket, mode 0600 or 0660 (0000 for the instant the
  daemon pauses or resumes it, supervisor/routing/connections.py), owned by the directory's owner or
  root: nobody else can create an entry in such a directory.

Anything else raises UntrustedRuntimeDir (a PermissionError): one line naming the path, its
owner and what is wrong. Nothing falls back to another directory. A directory that does not
exist raises NoDaemon: a connection left waiting on a path there would reach whoever creates
it first. What this user cannot see (a directory it may not search) is not judged here: the
connection's own check (client/ipcaccess.py) says who may reach it.

The checks use only the standard library (``modelwarden status`` stays light).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from modelwarden.shared.errors import NoDaemon

DIR_MODES = (0o700, 0o750)
PRIVATE_MODE = 0o700
SOCKET_MODES = (0o600, 0o660, 0o000)
ROOT_UID = 0
HINT = "set MODELWARDEN_ENDPOINT or MODELWARDEN_CONFIG to name the daemon you trust"


class UntrustedRuntimeDir(PermissionError):
    """A runtime directory or socket this client did not configure, made by someone it cannot
    trust: the message names the path, its owner and what is wrong."""


def check_runtime_dir(path: Path) -> os.stat_result:
    """The directory's status when this client may trust it; else UntrustedRuntimeDir, or
    NoDaemon when it does not exist."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise NoDaemon(f"no daemon: {path} does not exist (is the daemon running? "
                       f"{HINT} elsewhere)") from None
    problem = dir_problem(path, info, DIR_MODES, _trusted_dir_owners(path))
    if problem:
        raise _refusal(path, info, problem)
    return info


def check_socket_in(runtime: Path, path: Path) -> None:
    """``path`` (a socket at or below ``runtime``) and every directory between, as the daemon
    makes them. A socket that is absent passes (the daemon is starting or paused): only the
    directory's owner or root can create one there. One that we may not see is left alone."""
    owner = check_runtime_dir(runtime).st_uid
    trusted = {owner, ROOT_UID}
    directory = runtime
    for part in path.parent.relative_to(runtime).parts:  # private/, for admin.sock
        directory = directory / part
        info = _lstat(directory)
        if info is None:
            return
        problem = dir_problem(directory, info, (PRIVATE_MODE,), trusted)
        if problem:
            raise _refusal(directory, info, problem)
    info = _lstat(path)
    if info is not None:
        problem = socket_problem(info, trusted)
        if problem:
            raise _refusal(path, info, problem)


def dir_problem(path: Path, info: os.stat_result, modes: tuple, owners: set[int]) -> str | None:
    """What makes ``path`` a directory not to trust, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in owners:
        return _owner_problem(owners)
    return _mode_problem(info, modes)


def socket_problem(info: os.stat_result, owners: set[int]) -> str | None:
    """What makes a socket file one not to trust, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISSOCK(info.st_mode):
        return "is not a socket"
    if info.st_uid not in owners:
        return _owner_problem(owners)
    return _mode_problem(info, SOCKET_MODES)


def _trusted_dir_owners(path: Path) -> set[int]:
    owners = {os.geteuid(), ROOT_UID}
    # Only root can make an entry in a directory that root owns and only root may write: what
    # is there, root put there, whoever it belongs to (/run/modelwarden, made by systemd).
    try:
        parent = os.stat(path.parent)
    except OSError:
        return owners
    if parent.st_uid == ROOT_UID and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        owners.add(os.lstat(path).st_uid)
    return owners


def _owner_problem(owners: set[int]) -> str:
    names = " or ".join(user_name(uid) for uid in sorted(owners, reverse=True))
    return f"not by {names}"


def _mode_problem(info: os.stat_result, modes: tuple) -> str | None:
    mode = stat.S_IMODE(info.st_mode)
    if mode in modes:
        return None
    return f"has mode {mode:04o}, not {' or '.join(f'{m:04o}' for m in modes if m)}"


def _refusal(path: Path, info: os.stat_result, problem: str) -> UntrustedRuntimeDir:
    return UntrustedRuntimeDir(f"refusing {path}: it is owned by {user_name(info.st_uid)} and "
                               f"{problem}; another user may have made it to pose as the daemon "
                               f"({HINT})")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:  # absent, or in a directory we may not search: nothing to judge
        return None


def user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
