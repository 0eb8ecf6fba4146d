"""Logging for the daemon and its workers: text for terminals, one JSON object a line for
collectors. Every line names its process role and pid (``supervisor`` or ``mlp#0``).

Under systemd, stderr is a stream to journald, which gives every line priority 6 (info) unless
the line opens with a syslog priority, ``<N>``. When stderr *is* the journal -- systemd sets
``$JOURNAL_STREAM`` to the ``DEV:INODE`` of the stream it connected, and stderr's own fstat
matches it (a redirect, or a child given another stderr, does not) -- every line of a record
carries its priority: ``<2>`` CRITICAL, ``<3>`` ERROR, ``<4>`` WARNING, ``<6>`` INFO, ``<7>``
DEBUG, so ``journalctl -p warning`` shows what needs a look. Workers inherit both the variable
and the stream, so their lines carry it too; elsewhere nothing changes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Mapping, TextIO

# (lowest level, syslog priority), highest first: a level between two takes the lower's priority.
SYSLOG_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
                     (logging.INFO, 6))
SYSLOG_DEBUG = 7


class _RoleFilter(logging.Filter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        record.pid = os.getpid()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "role": getattr(record, "role", "?"),
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def syslog_priority(levelno: int) -> int:
    return next((priority for lowest, priority in SYSLOG_PRIORITIES if levelno >= lowest), SYSLOG_DEBUG)


class JournalPriorityFormatter(logging.Formatter):
    """Prefixes each line of what ``inner`` formats with the record's syslog priority: journald
    reads a traceback's lines as records of their own, and they belong to the same level."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in self.inner.format(record).split("\n"))


def stderr_is_journal(environ: Mapping[str, str] = os.environ, stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stderr) is the journal stream systemd named in $JOURNAL_STREAM."""
    dev, sep, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (sep and dev.isdigit() and inode.isdigit()):
        return False
    try:
        info = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):  # closed, or not a real file
        return False
    return (info.st_dev, info.st_ino) == (int(dev), int(inode))


TEXT_FORMAT = "%(asctime)s %(levelname)-8s %(role)s[%(pid)d] %(message)s"


def setup_logging(role: str, level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RoleFilter(role))
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    if stderr_is_journal():
        formatter = JournalPriorityFormatter(formatter)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
