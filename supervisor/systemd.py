"""systemd glue: sd_notify over $NOTIFY_SOCKET (READY, STATUS, STOPPING, WATCHDOG).

No dependency on libsystemd: the protocol is one datagram per message. Without
$NOTIFY_SOCKET every call is a no-op, so the daemon runs the same under a terminal.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


class Notifier:
    def __init__(self) -> None:
        address = os.environ.get("NOTIFY_SOCKET")
        self._address = None
        if address:
            # A leading '@' names an abstract socket: a NUL byte on the wire.
            self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = os.environ.get("WATCHDOG_USEC")
        watchdog_pid = os.environ.get("WATCHDOG_PID")
        own = watchdog_pid is None or watchdog_pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 2e6 if usec and usec.isdigit() and own else None

    def notify(self, message: str) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                # Never block the loop: a notify socket nobody reads fills after a few datagrams
                # (net.unix.max_dgram_qlen), and a blocking send would stop the whole daemon.
                sock.sendto(message.encode(), socket.MSG_DONTWAIT, self._address)
        except BlockingIOError:
            logger.warning("sd_notify dropped a message: the notify socket is full")
        except OSError as exc:
            logger.warning("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")
