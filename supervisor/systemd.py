"""systemd glue: sd_notify over $NOTIFY_SOCKET (READY, RELOADING, STATUS, STOPPING, WATCHDOG).

No dependency on libsystemd: the protocol is one datagram per message. Without
$NOTIFY_SOCKET every call is a no-op, so the daemon runs the same under a terminal.

What the daemon promises (``ServiceReporter``, fed with supervisor.health's view of the pools):
  * ``READY=1`` once every model has ``ready_min`` READY workers -- not when they are spawned --
    so ``systemctl start`` returns when requests can be served; until then ``STATUS=`` says
    what it waits for;
  * ``STATUS=`` whenever it changes: "N/M workers ready", what READY waits for, FATAL slots, and
    a model whose every slot is FATAL;
  * a reload (SIGHUP) opens with ``RELOADING=1`` and ``MONOTONIC_USEC=`` (CLOCK_MONOTONIC, as
    systemd requires) and closes with ``READY=1`` once the daemon is ready again and no old
    worker is still waiting for its replacement;
  * ``STOPPING=1`` when it starts to drain; ``WATCHDOG=1`` from the poll loop.
"""

from __future__ import annotations

import logging
import multiprocessing.resource_tracker
import os
import socket
import time

from modelwarden.supervisor.fleet.health import Health

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

    def reloading(self, status: str) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}\nSTATUS={status}")


class ServiceReporter:
    """Turns the daemon's health into READY/RELOADING/STATUS messages, each sent once: the
    loop may report as often as it likes (every tick), only changes reach systemd."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.announced = False  # READY=1 sent at least once
        self.reloading = False  # RELOADING=1 sent, its READY=1 not yet
        self._last_status: str | None = None

    def reload_started(self, health: Health) -> None:
        if not self.announced:
            return  # still starting: the first READY=1 covers the reload too
        self.reloading = True
        self._last_status = "reloading; " + health.status_line()
        self.notifier.reloading(self._last_status)

    def update(self, health: Health, stopping: bool) -> None:
        status = health.status_line()
        if self.reloading:
            status = "reloading; " + status
        if not stopping and not self.announced and health.ready:
            self.announced = True
            self.notifier.ready(status)
        elif not stopping and self.reloading and health.settled:
            self.reloading = False
            status = health.status_line()
            self.notifier.ready(status)
        elif status != self._last_status:
            self.notifier.status(status)
        self._last_status = status


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker (spawn starts it with the first worker) and reap
    it. It would leave by itself once the supervisor's end of its pipe closes, but only after the
    supervisor has gone, and KillMode=mixed SIGKILLs whatever is left in the unit by then: an
    ERROR-looking "Killing process ... with signal SIGKILL" at every clean stop."""
    tracker = multiprocessing.resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)  # private, in every CPython from 3.8 to 3.13
    if stop is not None:
        try:
            stop()
        except (OSError, ChildProcessError) as exc:
            logger.debug("resource tracker: %s", exc)
