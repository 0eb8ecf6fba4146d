"""Supervising the KServe v2 gateway process (``[gateway]`` in the configuration).

The gateway (gateway/main.py) is a multiprocessing *spawn* child, like a worker, but it serves
no model: it is an ordinary client of the daemon's frontend that speaks HTTP and gRPC to the
outside. The supervisor only keeps it alive; its poll loop never reads HTTP.

Its life, one process at a time, on the state machine ``GatewayState``:

    STARTING ──► READY ──► BACKOFF ──► STARTING ...        (it died: restarted)
        │          │
        └──────────┴──► STOPPING ──► STOPPED               (the daemon stops: it goes last)

* STARTING: spawned; it binds its listeners and says so on a pipe (one line, ``{"http": ADDR,
  "grpc": ADDR}`` with the ports actually bound) -> READY.
* Death (its ``Process.sentinel`` in the loop's poller) in STARTING or READY -> BACKOFF: a
  gateway that was READY for ``GOOD_RUN_S`` is restarted at once; one that died before READY
  (a port in use, a missing library) or soon after waits ``BACKOFF_INITIAL_S``, doubling up to
  ``BACKOFF_MAX_S``.
* At shutdown the gateway is stopped after the last worker: until then clients still hear
  SHUTTING_DOWN for new requests and get answers to accepted ones. SIGTERM, then SIGKILL after
  ``KILL_GRACE_S``.

The host (the Arbiter) lends its poller (``watch``/``unwatch``), its timers (``call_at``/
``cancel``) and its clock; nothing here blocks.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

from modelwarden.shared.config import Settings
from modelwarden.supervisor.fleet.handle import exit_cause

logger = logging.getLogger(__name__)

GOOD_RUN_S = 10.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
KILL_GRACE_S = 5.0
REQUIRED_MODULES = ("uvicorn", "httptools", "starlette", "grpc", "google.protobuf")


class GatewayState(str, enum.Enum):
    STARTING = "STARTING"  # spawned; binding its listeners
    READY = "READY"  # listening and serving
    BACKOFF = "BACKOFF"  # died; waiting out a delay before the next start
    STOPPING = "STOPPING"  # told to stop (SIGTERM) at the daemon's shutdown
    STOPPED = "STOPPED"  # not running and not to be started again


G = GatewayState
GATEWAY_TRANSITIONS: dict[GatewayState, frozenset[GatewayState]] = {
    G.STARTING: frozenset({G.READY, G.BACKOFF, G.STOPPING}),  # bound / died / shutdown
    G.READY: frozenset({G.BACKOFF, G.STOPPING}),  # died / shutdown
    G.BACKOFF: frozenset({G.STARTING, G.STOPPED}),  # delay over / shutdown
    G.STOPPING: frozenset({G.STOPPED}),  # exited
    G.STOPPED: frozenset({G.STARTING}),  # the first start (never again after a shutdown)
}


def missing_modules() -> list[str]:
    """The gateway extra's libraries not installed here (checked without importing them)."""
    missing = []
    for name in REQUIRED_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:  # a parent package is absent
            missing.append(name)
    return missing


USAGE_FILE = "gateway-usage.json"  # in the private directory: the daemon's user alone reads it
USAGE_READ_S = 1.0  # the keeper reads the file at most this often


@dataclass
class GatewaySpec:
    """Everything the gateway process needs; pickled through multiprocessing's spawn pipe."""

    frontend: str  # the daemon endpoint it is a client of (ipc: large tensors via shared memory)
    http: str | None
    grpc: str | None
    max_message_bytes: int
    supervisor_pid: int
    max_connections: int = 4096  # per listener
    read_timeout: float = 30.0  # a whole request, or a gRPC handshake
    token_file: str | None = None  # absolute; None: no token asked (gateway/access.py)
    socket_group: str | None = None  # the group of unix: listeners (daemon.shm_group)
    tls_cert: str | None = None  # absolute; both or neither (TLS on both listeners)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # callers need a certificate this CA signed
    log_level: str = "INFO"
    log_format: str = "text"
    max_json_bytes: int = 8 * 1024 * 1024  # the JSON part of a REST request
    max_requests_in_flight: int = 1024  # all callers together
    max_bytes_in_flight: int = 1024**3  # request bytes, all callers together
    identity_share: float = 0.25  # of both, for one caller (gateway/quota.py)
    usage_file: str | None = None  # where it writes what each caller holds (RUNTIME/private/)


def gateway_spec(settings: Settings, supervisor_pid: int) -> GatewaySpec:
    config = settings.gateway
    ipc = [endpoint for endpoint in settings.frontends if endpoint.startswith("ipc://")]
    max_message_bytes = config.max_message_bytes or settings.daemon.max_message_bytes
    return GatewaySpec(frontend=ipc[0], http=config.http, grpc=config.grpc,
                       max_message_bytes=max_message_bytes,
                       max_json_bytes=config.max_json_bytes,
                       max_requests_in_flight=config.max_requests_in_flight,
                       max_bytes_in_flight=config.max_bytes_in_flight or 4 * max_message_bytes,
                       identity_share=config.identity_share,
                       supervisor_pid=supervisor_pid, max_connections=config.max_connections,
                       read_timeout=config.read_timeout,
                       token_file=str(settings.resolve(config.token_file)) if config.token_file else None,
                       socket_group=settings.daemon.shm_group,
                       tls_cert=str(settings.resolve(config.tls_cert)) if config.tls_cert else None,
                       tls_key=str(settings.resolve(config.tls_key)) if config.tls_key else None,
                       tls_client_ca=(str(settings.resolve(config.tls_client_ca))
                                      if config.tls_client_ca else None),
                       log_level=settings.daemon.log_level,
                       log_format=settings.daemon.log_format,
                       usage_file=str(settings.private_dir / USAGE_FILE))


class GatewayKeeper:
    def __init__(self, spec: GatewaySpec, *, watch: Callable, unwatch: Callable,
                 call_at: Callable, cancel: Callable, clock: Callable[[], float]) -> None:
        self.spec = spec
        self._watch, self._unwatch = watch, unwatch
        self._call_at, self._cancel = call_at, cancel
        self.clock = clock
        self.state = GatewayState.STOPPED
        self.process: multiprocessing.process.BaseProcess | None = None
        self._usage: list[dict] = []
        self._usage_read_at = float("-inf")
        self.pid: int | None = None  # the current or last process's
        self._pipe: multiprocessing.connection.Connection | None = None
        self.addresses: dict[str, str | None] = {}
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.restarts = 0
        self.failed_starts = 0  # in a row; a good run resets it
        self.last_exit: str | None = None
        self._timer = None
        self._spawn = multiprocessing.get_context("spawn")

    # -- state ------------------------------------------------------------------------------

    def _become(self, state: GatewayState, why: str = "") -> None:
        if state not in GATEWAY_TRANSITIONS[self.state]:
            raise RuntimeError(f"gateway: illegal transition {self.state.value} -> {state.value}")
        logger.info("gateway pid %s: %s -> %s%s", self.pid, self.state.value, state.value,
                    f" ({why})" if why else "")
        self.state = state

    # -- starting ---------------------------------------------------------------------------

    def start(self) -> None:
        from modelwarden.gateway import main as gateway_main  # stdlib-only at import time

        self._timer = None
        self._become(G.STARTING, "backoff over" if self.state == G.BACKOFF else "first start")
        reader, writer = self._spawn.Pipe(duplex=False)
        process = self._spawn.Process(target=gateway_main.run, args=(self.spec, writer),
                                      name="modelwarden gateway")
        try:
            process.start()
        except Exception as exc:  # no process, no sentinel: try again later
            reader.close()
            self.failed_starts += 1
            logger.error("gateway: cannot spawn: %s", exc)
            self._become(G.BACKOFF, "spawn failed")
            self._timer = self._call_at(self.clock() + BACKOFF_MAX_S, self.start)
            return
        finally:
            writer.close()
        self.process, self._pipe, self.pid = process, reader, process.pid
        self.started_at, self.ready_at, self.addresses = self.clock(), None, {}
        self._watch(process.sentinel, self._on_exit)
        self._watch(reader.fileno(), self._on_pipe)
        logger.info("gateway: spawned pid %d (http %s, grpc %s)", process.pid, self.spec.http,
                    self.spec.grpc)

    def _on_pipe(self) -> None:
        """The gateway's one line: the addresses it bound. EOF: it is exiting (the sentinel
        says so too); stop watching the pipe either way."""
        try:
            line = self._pipe.recv_bytes(4096)
        except (EOFError, OSError):
            self._close_pipe()
            return
        try:
            addresses = json.loads(line)
        except ValueError:
            addresses = None
        if not isinstance(addresses, dict) or self.state != G.STARTING:
            logger.warning("gateway: unexpected message on its pipe; ignored")
            return
        self.addresses = {key: addresses.get(key) for key in ("http", "grpc")}
        self.ready_at = self.clock()
        self._become(G.READY, ", ".join(f"{key} {value}" for key, value in self.addresses.items()
                                        if value))

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            self._unwatch(self._pipe.fileno())
            self._pipe.close()
            self._pipe = None

    # -- death ------------------------------------------------------------------------------

    def _on_exit(self) -> None:
        process = self.process
        if process is None or not multiprocessing.connection.wait([process.sentinel], 0):
            return  # stale: reaped already
        process.join(5)
        code = process.exitcode
        self._unwatch(process.sentinel)
        self._close_pipe()
        process.close()
        self.process = None
        self.last_exit = exit_cause(code)
        if self.state == G.STOPPING:
            self._cancel(self._timer)
            self._timer = None
            self._become(G.STOPPED, self.last_exit)
            return
        good_run = self.ready_at is not None and self.clock() - self.ready_at >= GOOD_RUN_S
        self.failed_starts = 0 if good_run else self.failed_starts + 1
        delay = 0.0 if good_run else min(BACKOFF_MAX_S,
                                         BACKOFF_INITIAL_S * 2 ** (self.failed_starts - 1))
        self.restarts += 1
        level = logging.WARNING if good_run else logging.ERROR
        logger.log(level, "gateway exited (%s); restarting in %.1fs", self.last_exit, delay)
        self._become(G.BACKOFF, f"restart in {delay:.1f}s")
        self._timer = self._call_at(self.clock() + delay, self.start)

    # -- stopping ---------------------------------------------------------------------------

    def stop_last(self) -> bool:
        """Called once every worker is gone at shutdown: stop the gateway; True once it has
        exited (the loop may end then)."""
        if self.state == G.STOPPED:
            return True
        if self.state == G.BACKOFF:
            self._cancel(self._timer)
            self._timer = None
            self._become(G.STOPPED, "shutdown")
            return True
        if self.state in (G.STARTING, G.READY):
            self._become(G.STOPPING, "shutdown")
            self._signal(signal.SIGTERM)
            self._timer = self._call_at(self.clock() + KILL_GRACE_S, self._kill)
        return False

    def _kill(self) -> None:
        self._timer = None
        if self.process is not None:
            logger.warning("gateway did not stop within %.0fs: SIGKILL", KILL_GRACE_S)
            self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.pid:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """The daemon is exiting: whatever is left of the gateway goes now."""
        self._cancel(self._timer)
        if self.process is not None:
            self._signal(signal.SIGKILL)
            self.process.join(5)
            self._unwatch(self.process.sentinel)
            self.process = None
        self._close_pipe()

    # -- status -----------------------------------------------------------------------------

    def row(self) -> dict[str, Any]:
        now = self.clock()
        return {"state": self.state.value, "pid": self.process.pid if self.process else None,
                "http": self.addresses.get("http") or self.spec.http,
                "grpc": self.addresses.get("grpc") or self.spec.grpc,
                "uptime_s": round(now - self.started_at, 3) if self.process and self.started_at else None,
                "restarts": self.restarts, "last_exit": self.last_exit,
                "access": self.access(), "identities": self.usage()}

    def usage(self) -> list[dict]:
        """What each caller holds at the gateway (its calls and request bytes in flight), as
        the gateway last wrote it (gateway/main.py); read at most once a USAGE_READ_S."""
        now = self.clock()
        if now - self._usage_read_at >= USAGE_READ_S:
            self._usage_read_at = now
            self._usage = _read_usage(self.spec.usage_file) if self.state == GatewayState.READY else []
        return self._usage

    def access(self) -> list[str]:
        """What stands between a caller and the models, beyond reaching the address."""
        spec = self.spec
        return ([name for name, on in (("tls", spec.tls_cert), ("client-certificates", spec.tls_client_ca),
                                       ("tokens", spec.token_file)) if on]
                or ["none"])


def _read_usage(path: str | None) -> list[dict]:
    if path is None:
        return []
    try:
        with open(path, "rb") as handle:
            usage = json.loads(handle.read(1 << 20))
    except (OSError, ValueError):
        return []
    if not isinstance(usage, dict):
        return []
    return [{"identity": str(identity), "requests": int(use.get("requests", 0)),
             "request_bytes": int(use.get("bytes", 0))}
            for identity, use in usage.items() if isinstance(use, dict)]


def cannot_run(settings: Settings) -> str | None:
    """Why a configured gateway cannot run (checked before the daemon starts), or None."""
    missing = missing_modules()
    if missing:
        return (f"[gateway] is configured but {', '.join(missing)} is not installed: "
                "pip install 'modelwarden[gateway]' (or remove the [gateway] section)")
    if not any(endpoint.startswith("ipc://") for endpoint in settings.frontends):
        return ("[gateway] needs an ipc:// frontend to reach the daemon as a local client; "
                "daemon.frontend lists only tcp endpoints: add ipc://RUNTIME_DIR/frontend.sock")
    config = settings.gateway
    from modelwarden.shared.secretfiles import SecretFileError, check_tls, read_tokens

    try:
        if config.token_file is not None:
            read_tokens(settings.resolve(config.token_file))
        if config.tls_cert is not None:
            check_tls(settings.resolve(config.tls_cert), settings.resolve(config.tls_key),
                      settings.resolve(config.tls_client_ca) if config.tls_client_ca else None)
    except SecretFileError as exc:
        return f"[gateway] {exc}"
    return None


