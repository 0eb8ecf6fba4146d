"""What every process of ours needs about itself, apart from its role: that it dies with its
parent, and that the ipc socket files it binds are its own to bind and are closed to others.

The supervisor (supervisor/runtime.py), its workers and its gateway use these; keeping them here
means that neither the worker nor the gateway imports the supervisor.
"""

from __future__ import annotations

import ctypes
import grp
import logging
import os
import signal
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class DaemonError(RuntimeError):
    """The daemon cannot start (runtime directory, lock, endpoints)."""


def die_with_parent(supervisor_pid: int) -> bool:
    """Ask the kernel to SIGKILL us when the supervisor dies, even by SIGKILL. False if the
    supervisor is already gone (it died before the request took effect)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent pipe only")
    return os.getppid() == supervisor_pid


def check_socket_path(path: Path) -> None:
    """Binding replaces a socket file; anything else at that path is not ours to replace."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DaemonError(f"cannot bind {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise DaemonError(f"refusing to bind {path}: something that is not a socket is there")


def restrict_socket(path: Path, group: str | None) -> None:
    """An ipc socket file we just bound: 0600, or group-owned 0660 when ``group`` is given."""
    try:
        if group:
            os.chown(path, -1, group_id(group))
        os.chmod(path, 0o660 if group else 0o600)
    except OSError as exc:
        raise DaemonError(f"cannot set the permissions of {path}: {exc}") from None


def group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise DaemonError(f"daemon.shm_group: no group named {group!r}") from None
