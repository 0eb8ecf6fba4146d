"""The supervisor's loop: one ``poll()`` per pass, its timeout the nearest deadline.

Each pass drains what each readable socket holds, up to a bound per socket (the poller is
level-triggered, shared/sockets.Poller, so the next pass sees whatever is left), which keeps every socket served in
turn; client and worker messages are drained by supervisor/routing/intake.py, compiled.
Everything that happens is an event on the poller: a client message (frontend ROUTERs), a buffer-channel connection or
message (raw Unix sockets, ``supervisor/routing/bufferserver.py``), a worker
message (its link, shared/link.py, admitted by supervisor/fleet/workerauth.py), a control command (control ROUTER:
read-only; admin ROUTER: all), a signal (the wakeup socket that
``signal.set_wakeup_fd`` writes to), or a worker's death (its ``Process.sentinel``). Timers --
request deadlines, backoff restarts, kill escalation, the health tick -- set the poll timeout,
from ``time.monotonic()``. Signal handlers only record; the loop turns
signals into the same commands the control socket takes.

The Arbiter keeps the loop (its round, compiled, is supervisor/eventloop.py: the Arbiter says what
is watched and when the loop ends), the sockets, the signals, spawning and reaping. What is done to the
workers is the fleet's (supervisor/fleet/fleet.py: restart, stop, a reload's plan, shutdown) and
each pool's; requests are the router's (supervisor/routing/router.py). Commands reach the Arbiter
through ``CommandHost`` (supervisor/commands.py), pools through ``PoolHost``, the router through
``RouterHost``: each names all that its side may ask.
"""

from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

import zmq

from modelwarden import compiled
from modelwarden.shared import __version__, protocol
from modelwarden.shared.link import Link
from modelwarden.shared.sockets import Poller, recv_parts, send_parts
from modelwarden.shared.config import ConfigError, ModelConfig, Settings, WorkerSpec, load_settings
from modelwarden.shared.protocol import (BAD_REQUEST, INTERNAL, NO_WORKER, SHUTTING_DOWN, SIGNATURE,
                                         ProtocolError)
from modelwarden.shared.states import EXIT_MODEL_FATAL
from modelwarden.supervisor import accesslog, auth, gatewaykeeper
from modelwarden.supervisor.routing.buffers import MAX_BUFFERS, BufferRegistry
from modelwarden.supervisor.routing.bufferserver import MAX_CONNECTIONS as MAX_CHANNEL_CONNECTIONS, BufferServer
from modelwarden.supervisor.commands import ADMIN_ONLY, COMMANDS
from modelwarden.supervisor.status import status_snapshot
from modelwarden.supervisor.routing.connections import BACKLOG, ConnectionGuard, raise_fd_limit
from modelwarden.supervisor.fleet.handle import WorkerHandle
from modelwarden.supervisor.fleet.health import daemon_health
from modelwarden.supervisor.fleet.placement import SlotPlacement, available_cores, plan
from modelwarden.supervisor.fleet.pool import ModelPool
from modelwarden.supervisor.fleet import probes
from modelwarden.supervisor.fleet.fleet import Fleet
from modelwarden.supervisor.routing import identity, localfront, zmtpfront
from modelwarden.supervisor.routing.quotas import Quotas, max_buffer_bytes, shares_from
from modelwarden.supervisor.fleet import reload
from modelwarden.supervisor.routing.intake import Intake
from modelwarden.supervisor.routing.router import Router
from modelwarden.supervisor.fleet.standby import placement_for
from modelwarden.shared.process import DaemonError, check_socket_path, restrict_socket
from modelwarden.supervisor.runtime import (check_private_endpoint, claim_private_dir,
                                            claim_runtime_dir, sweep_unserved_local)
from modelwarden.supervisor.systemd import Notifier, ServiceReporter, stop_resource_tracker
from modelwarden.supervisor.timers import Timers
from modelwarden.supervisor.eventloop import EventLoop
from modelwarden.supervisor.fleet.versions import VersionBook
from modelwarden.supervisor.fleet.workerauth import WorkerGate, new_secret
from modelwarden.worker import main as worker_main

logger = logging.getLogger(__name__)

TICK = 0.1  # health checks: heartbeats, probe timeouts, memory, drain deadlines
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # no meaning yet: logged, never fatal
CONTROL_INDEX = -1  # control.sock's index (in its connections' keys): no frontend has it
FRONTEND_HWM = 100_000  # a ROUTER drops what exceeds its HWM: replies must not be dropped


class Arbiter:
    def __init__(self, settings: Settings, placements: dict[str, list[SlotPlacement]] | None = None):
        self.settings = settings
        self.clock = time.monotonic
        self.timers = Timers()
        # Shares per identity; the connection share is fixed again once the marks are (run).
        self.quotas = Quotas(shares_from(settings, MAX_CHANNEL_CONNECTIONS, MAX_BUFFERS),
                             house=identity.uid_identity(os.geteuid()))
        self.router = Router(self)
        self.registry = BufferRegistry(max_bytes=max_buffer_bytes(settings), quotas=self.quotas)
        self.buffer_server: BufferServer | None = None
        self.notifier = Notifier()
        self.service = ServiceReporter(self.notifier)
        self.exit_code = 0
        self.versions = VersionBook(settings.base_dir, self._python_path())
        placements = placements or plan(settings)
        self.fleet = Fleet({model.name: self._new_pool(model, placements[model.name],
                                                   probes.judge_for(model, settings))
                            for model in settings.models})
        # Model name -> its pool (what the router, status and metrics read): the fleet's own
        # dict, which it changes in place for the daemon's life. An attribute, not a property:
        # the router reads it per request, and a property is an interpreted call each time.
        self.pools: dict[str, ModelPool] = self.fleet.pools
        self.pid = os.getpid()
        self.started_at = self.clock()
        self.stopping = False
        self._stop_deadline: float | None = None
        self._workers_told_to_stop = False
        self.gate = WorkerGate(self.clock)
        self._by_sentinel: dict[int, WorkerHandle] = {}
        self._watched_links: set[int] = set()  # the link descriptors in the loop
        self._spawn = multiprocessing.get_context("spawn")
        self._lock = None
        self.context = zmq.Context()
        self.loop = EventLoop(Poller(), self.timers, self.clock)  # one round of _loop
        self.frontends: list[zmq.Socket] = []
        self._frontend_is_ipc: list[bool] = []
        self.frontend_transports: list[str] = []  # how each frontend's peers are known (identity)
        self.control: zmq.Socket | None = None
        self.connections: ConnectionGuard | None = None
        self.server_keys = auth.read_server_keys(settings)  # None: tcp frontends are plaintext
        self.zap: auth.ZapHandler | None = None
        self.admin: zmq.Socket | None = None
        self._wakeup_read, self._wakeup_write = socket.socketpair()
        self.telemetry = None  # supervisor/metrics.py, when [daemon] metrics is set
        self.metrics_server = None
        self.gateway = None  # supervisor/gatewaykeeper.py's GatewayKeeper, when [gateway] is set
        self.intake = Intake(self)  # last: it keeps references to what is above

    def pool_of(self, handle: WorkerHandle) -> ModelPool | None:
        return self.fleet.pool_of(handle)

    @property
    def leaving_pools(self) -> list[ModelPool]:
        return self.fleet.leaving

    def _new_pool(self, config: ModelConfig, placements: list[SlotPlacement],
                  judge: probes.ProbeJudge) -> ModelPool:
        return ModelPool(config, placements, self, judge)

    def _python_path(self) -> list[str]:
        # The configured directories, then the interpreter's own: never the daemon's cwd
        # (shared/syspath.py says why).
        from modelwarden.shared.syspath import worker_path

        return worker_path(str(self.settings.resolve(p)) for p in self.settings.daemon.python_path)

    # -- life -------------------------------------------------------------------------------

    def run(self) -> int:
        problem = self.settings.gateway is not None and gatewaykeeper.cannot_run(self.settings)
        if problem:
            raise DaemonError(problem)
        # Spawned children start as `python -c ...`, which puts '' (the working directory) first
        # on sys.path until multiprocessing replaces it: a module planted there under a name the
        # bootstrap imports (multiprocessing itself) would run in every worker. -P for them all.
        os.environ["PYTHONSAFEPATH"] = "1"
        self.connections = ConnectionGuard(raise_fd_limit(), self.settings.daemon.max_connections,
                                           quotas=self.quotas)
        self._lock = claim_runtime_dir(self.settings.runtime_dir, self.settings.daemon.shm_group)
        sweep_unserved_local(self.settings.runtime_dir, self.settings.frontends)
        claim_private_dir(self.settings.private_dir)
        check_private_endpoint(Path(self.settings.admin_endpoint[len("ipc://"):]))
        self._bind()
        self._start_observers()
        self._open_buffer_channel()
        self._install_signal_handlers()
        self.connections.start(sum(len(pool.slots) for pool in self.pools.values()))
        self._set_shares(self.settings)
        now = self.clock()
        self.timers.call_at(now + TICK, self._tick)
        if self.notifier.watchdog_interval:
            self.timers.call_at(now, self._watchdog)
        for pool in self.pools.values():
            pool.start_all()
        self._start_gateway()
        logger.info("modelwarden %s serving %s on %s (control %s, admin %s)", __version__,
                    ", ".join(self.pools) or "no models", " ".join(self.settings.frontends),
                    self.settings.control_endpoint, self.settings.admin_endpoint)
        self._log_request_path()
        self._report_health()
        gc.freeze()  # start-up objects live forever: keep the collector from rescanning them
        try:
            self._loop()
        finally:
            self._close()
        logger.info("stopped")
        return self.exit_code

    def _log_request_path(self) -> None:
        """Compiled or not (modelwarden/compiled.py): a module compiled from an older source
        than the one beside it runs code nobody reads, so that one is a warning."""
        states = compiled.report()
        level = logging.WARNING if compiled.STALE in states.values() else logging.INFO
        logger.log(level, "%s", compiled.summary(states))

    def _loop(self) -> None:
        # The gateway goes last: it answers its callers until every worker has left.
        while not (self.stopping and not self._by_sentinel
                   and (self.gateway is None or self.gateway.stop_last())):
            # Workers freed by the results of this round take their next requests together:
            # once per model per round, after every result of the round is in.
            self.loop.turn(self.router.dispatch_wanted)
        # No worker is left to serve what is still queued (every slot was restarting, or the
        # last one died while draining): answer it rather than leave it without a reply.
        self.router.fail_everything(SHUTTING_DOWN, "the daemon stopped before a worker could serve it")

    def _start_gateway(self) -> None:
        if self.settings.gateway is not None:
            self.gateway = gatewaykeeper.GatewayKeeper(
                gatewaykeeper.gateway_spec(self.settings, self.pid), watch=self._on, unwatch=self._off,
                call_at=self.timers.call_at, cancel=self.timers.cancel, clock=self.clock)
            self.gateway.start()

    def _start_observers(self) -> None:
        """The access log and the metrics endpoint: each one only when configured (the metrics
        module, and prometheus_client, are not even imported otherwise)."""
        daemon = self.settings.daemon
        if daemon.access_log:
            accesslog.enable()
            self.router.observers.append(accesslog.answered)
        if daemon.metrics:
            from modelwarden.supervisor import metrics

            self.telemetry, self.metrics_server = metrics.start(
                daemon.metrics, self.router, watch=self._on, unwatch=self._off,
                call_at=self.timers.call_at, cancel=self.timers.cancel, clock=self.clock,
                guard=self.connections)
            self.connections.add_listener(self.metrics_server)

    def _bind(self) -> None:
        daemon = self.settings.daemon
        old_umask = os.umask(0o007 if daemon.shm_group else 0o077)
        try:
            self._start_zap()
            for index, endpoint in enumerate(self.settings.frontends):
                self._frontend_is_ipc.append(not endpoint.startswith("tcp://"))
                self.frontend_transports.append(
                    identity.transport_of(endpoint, self.server_keys is not None))
                if localfront.is_local(endpoint):
                    self.frontends.append(self._local_frontend(index, endpoint,
                                                               localfront.LocalFrontend))
                    continue
                if zmtpfront.is_zmtp(endpoint):
                    self.frontends.append(self._local_frontend(index, endpoint,
                                                               zmtpfront.ZmtpFrontend))
                    continue
                sock = self._router_socket(endpoint, client_facing=True)
                self.frontends.append(sock)
                self._on(sock, functools.partial(self.intake.drain_clients, index))
                self._watch_connections(sock, endpoint, pausable=True)
            self._bind_control(self.settings.control_endpoint)
        finally:
            os.umask(old_umask)
        self._bind_private()

    def _bind_control(self, endpoint: str) -> None:
        """``control.sock``: the loop's own ZMTP listener at a path, as the ``ipc://`` frontends.
        libzmq's ``ipc://`` listener aborts the process when ``accept`` fails with EMFILE
        (supervisor/routing/connections.py), and its I/O thread accepts ahead of the loop that
        pauses it; the loop's own listener admits each connection before it holds it. An
        abstract ``ipc://@NAME`` or a ``tcp://`` endpoint stays libzmq's ROUTER."""
        if zmtpfront.is_zmtp(endpoint):
            self.control = self._local_frontend(CONTROL_INDEX, endpoint, zmtpfront.ZmtpFrontend,
                                                on_message=self._on_control_message)
            return
        self.control = self._router_socket(endpoint, client_facing=True)
        self._on(self.control, self._on_control, quiet=True)
        self._watch_connections(self.control, endpoint, pausable=True)

    def _local_frontend(self, index: int, endpoint: str, kind: type,
                        on_message: Callable | None = None) -> localfront.LocalFrontend:
        """A ``unix://`` frontend, or an ``ipc://`` one (``kind`` ZmtpFrontend): its listener
        and connections are the loop's own. ``on_message``: the intake's, unless given."""
        poller = self.loop.poller
        front = kind(
            index, endpoint, self.settings.daemon.shm_group, self.settings.daemon.max_message_bytes,
            self.connections, on_message or self.intake.client_message, watch=self._on,
            unwatch=self._off,
            want_write=poller.want_write, want_read=poller.want_read,
            later=lambda delay, then: self.timers.call_at(self.clock() + delay, then),
            clock=self.clock, gateway=self._is_gateway, uncapped=self.router.replies.uncapped)
        front.listen()
        self.connections.add_listener(front)
        return front

    def _is_gateway(self, pid: int) -> bool:
        """The peer is the gateway this daemon spawned (a child: its pid is not reused while it
        is not reaped)."""
        gateway = self.gateway
        return gateway is not None and gateway.process is not None and gateway.process.pid == pid

    def _bind_private(self) -> None:
        """The socket only the daemon's user may reach: mutating commands. (Workers are reached
        on links, which have no address at all.)"""
        old_umask = os.umask(0o077)
        try:
            self.admin = self._router_socket(self.settings.admin_endpoint, client_facing=True,
                                             private=True)
            self._on(self.admin, self._on_admin, quiet=True)
            self._watch_connections(self.admin, self.settings.admin_endpoint, pausable=False)
        finally:
            os.umask(old_umask)
        auth.warn_plaintext(self.settings)

    def _start_zap(self) -> None:
        # Before any frontend binds: a CURVE handshake must never find no handler.
        if self.server_keys is not None:
            self.zap = auth.ZapHandler(self.context, self.settings.resolve(
                self.settings.daemon.curve.client_keys), self.clock)
            self.zap.start()
            # Loud: every handshake waits on it, and a request that came in while another was
            # answered must not wait for the next reason to look (on_request drains, too).
            self._on(self.zap.zap_socket, self.zap.on_request)

    def _watch_connections(self, sock: zmq.Socket, endpoint: str, pausable: bool) -> None:
        monitor = self.connections.watch(sock, endpoint, pausable)
        self._on(monitor, functools.partial(self.connections.on_monitor, monitor), quiet=True)

    def _router_socket(self, endpoint: str, client_facing: bool, private: bool = False) -> zmq.Socket:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        if client_facing:
            sock.setsockopt(zmq.MAXMSGSIZE, self.settings.daemon.max_message_bytes)
            sock.setsockopt(zmq.SNDHWM, FRONTEND_HWM)
            sock.setsockopt(zmq.RCVHWM, FRONTEND_HWM)
            sock.setsockopt(zmq.BACKLOG, BACKLOG)
        else:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        if client_facing and self.server_keys is not None and endpoint.startswith("tcp://"):
            auth.make_curve_server(sock, self.server_keys)
        if endpoint.startswith("ipc://"):
            Path(endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
            check_socket_path(Path(endpoint[len("ipc://"):]))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise DaemonError(f"cannot bind {endpoint}: {exc}") from None
        if endpoint.startswith("ipc://"):
            restrict_socket(Path(endpoint[len("ipc://"):]),
                            None if private else self.settings.daemon.shm_group)
        return sock

    def _on(self, item, handler, quiet: bool = False) -> None:
        """``quiet``: a zmq socket only its handler reads or writes (shared/sockets.Poller): the
        frontends are not, since the router writes to them between polls."""
        self.loop.watch(item, handler, quiet)

    def _off(self, item) -> None:
        self.loop.unwatch(item)

    def _install_signal_handlers(self) -> None:
        self._wakeup_read.setblocking(False)
        self._wakeup_write.setblocking(False)
        signal.set_wakeup_fd(self._wakeup_write.fileno(), warn_on_full_buffer=False)
        for signum in (*STOP_SIGNALS, signal.SIGHUP, *IGNORED_SIGNALS):
            # The C-level handler writes the signal number to the wakeup socket: that is the
            # record. The Python handler exists only to replace the default action.
            signal.signal(signum, lambda *_: None)
        self._on(self._wakeup_read.fileno(), self._on_signal)

    def _close(self) -> None:
        for handle in list(self._by_sentinel.values()):
            handle.signal(signal.SIGKILL)
            handle.process.join(5)
            handle.exitcode = handle.process.exitcode
        signal.set_wakeup_fd(-1)
        if self.gateway is not None:
            self.gateway.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.buffer_server is not None:
            self.buffer_server.close()
        self.registry.close()
        if self.connections is not None:
            self.connections.close()
        for sock in (*self.frontends, self.control, self.admin):
            if sock is not None:
                sock.close()
        if self.zap is not None:
            self.zap.stop()
        self.context.term()
        stop_resource_tracker()
        if self._lock is not None:
            self._lock.close()

    def _report_health(self) -> None:
        """Tell systemd what changed (READY=1 only once every model has its minimum READY);
        with ``fatal_exits``, a model beyond help stops the daemon with EXIT_MODEL_FATAL."""
        health = daemon_health(self.pools.values())
        self.service.update(health, self.stopping)
        if health.dead and self.settings.daemon.fatal_exits and not self.stopping:
            logger.critical("every worker of %s is FATAL: stopping with exit code %d (fatal_exits)",
                            ", ".join(health.dead), EXIT_MODEL_FATAL)
            self.exit_code = EXIT_MODEL_FATAL
            self.request_stop("fatal_exits")

    # -- events -----------------------------------------------------------------------------

    def _on_signal(self) -> None:
        try:
            data = self._wakeup_read.recv(64)
        except BlockingIOError:
            return
        for signum in data:
            if signum in STOP_SIGNALS:
                self.request_stop(signal.Signals(signum).name)
            elif signum == signal.SIGHUP and not self.stopping:
                logger.info("SIGHUP: reloading the configuration")
                try:
                    self.reload()
                except ProtocolError:
                    pass  # refused: logged, and the running configuration serves on
            elif signum in IGNORED_SIGNALS:
                logger.info("%s ignored: it has no meaning to modelwarden", signal.Signals(signum).name)

    def shm_offered(self, index: int) -> bool:
        return self.buffer_server is not None and self._frontend_is_ipc[index]

    def _open_buffer_channel(self) -> None:
        if not self.settings.daemon.shm:
            return
        self.buffer_server = BufferServer(
            self.registry, self.settings.runtime_dir / "buffers.sock", self.settings.daemon.shm_group,
            watch=self._on, unwatch=self._off,
            pause=lambda delay, then: self.timers.call_at(self.clock() + delay, then),
            on_revoked=self.forget_buffers, guard=self.connections, clock=self.clock)
        self.buffer_server.listen()
        self.connections.add_listener(self.buffer_server)

    def _set_shares(self, settings: Settings) -> None:
        guard = self.connections
        self.quotas.shares = shares_from(settings, guard.high_water, min(self.registry.total, guard.room))

    def hello(self, index: int) -> dict:
        """What a client's ``hello`` is answered (supervisor/routing/intake.py asks)."""
        daemon = self.settings.daemon
        return {"protocol": protocol.PROTOCOL_VERSION, "version": __version__,
                "models": [{"name": pool.name, "workers": len(pool.slots),
                            "inputs": [spec.model_dump() for spec in pool.config.inputs or []],
                            **self._model_offer(pool)}
                           for pool in self.pools.values()],
                "stopping": self.stopping,
                "shm": {"enabled": self.shm_offered(index), "threshold": daemon.shm_threshold,
                        "channel": str(self.buffer_server.path) if self.buffer_server else None},
                "max_message_bytes": daemon.max_message_bytes}

    def _model_offer(self, pool: ModelPool) -> dict:
        """What the gateway reports about a model: readiness, outputs (declared, else learned
        from its READY workers' warm-up), version, batching."""
        config = pool.config
        version = self.versions.of(config)
        outputs, declared = pool.outputs_of(version)
        return {"ready": pool.ready_count(), "version": version,
                "outputs": outputs, "outputs_declared": declared,
                "batch_dim": config.batching.dim if config.batching.enabled else None,
                "max_batch_size": config.batching.max_size if config.batching.enabled else 0,
                "batch_delay_us": config.batching.max_delay_us if config.batching.enabled else 0,
                "timeout": config.timeout}

    def _on_control(self) -> None:
        self._control_message(self.control, recv_parts(self.control), admin=False)

    def _on_control_message(self, index, front, frames: list, *_) -> None:
        """A message on the loop's own ``control.sock`` (the routing id in front, as a ROUTER's)."""
        self._control_message(front, frames, admin=False)

    def _on_admin(self) -> None:
        self._control_message(self.admin, recv_parts(self.admin), admin=True)

    def _control_message(self, sock: zmq.Socket, frames: list, admin: bool) -> None:
        request_id = None
        try:
            envelope = protocol.split_router_message(frames)
            raw = envelope.header  # a zmq.Frame from libzmq, bytes from the loop's own listener
            header = protocol.unpack_header(getattr(raw, "buffer", raw))
            request_id = protocol.request_id_of(header)
            kind = header.get("type")
            command = COMMANDS.get(kind) if isinstance(kind, str) else None
            if command is None:
                raise ProtocolError(BAD_REQUEST, f"unknown command; known: {', '.join(COMMANDS)}")
            if command.mutating and not admin:
                raise ProtocolError(BAD_REQUEST, ADMIN_ONLY.format(command=command.name,
                                                                   admin=self.settings.admin_endpoint))
            reply = command.execute(self, header)
            reply.update(id=request_id, ok=True)
        except ProtocolError as exc:
            reply = protocol.error_header(request_id, exc.code, exc.message)
        except Exception:  # a bug in a command: answer, log, keep serving
            logger.exception("control command failed")
            reply = protocol.error_header(request_id, INTERNAL, "internal error; see the daemon's log")
        send_parts(sock, [*protocol.reply_route(frames), SIGNATURE, protocol.pack(reply)])

    def worker_message(self, handle: WorkerHandle, frames: list) -> None:
        """A message of ``handle``'s off the request path (supervisor/routing/intake.py hands
        over every one but an authenticated worker's result): the gate, then what it says."""
        try:
            header = protocol.unpack_header(frames[0], strict=False)
        except ProtocolError as exc:
            self.gate.refuse(handle, f"unreadable header: {exc.message}")
            return
        if not self.gate.admit(handle, header):
            return
        if not handle.alive:
            return  # declared dead (hung, timed out): whatever it says now is too late
        handle.last_seen = self.clock()
        pool = self.fleet.pool_of(handle)
        kind = header.get("type")
        if kind == protocol.RESULT:
            self.router.on_result(pool, handle, header, frames[1:])
        elif kind == protocol.RESULTS:
            self.router.on_results(pool, handle, header, frames[1:])
        elif kind == protocol.HEARTBEAT:
            handle.cuda_bytes = header.get("cuda_bytes")
        elif kind == protocol.STATE:
            pool.on_worker_state(handle, header.get("state"), header.get("info") or {})
            self._report_health()
        elif kind == protocol.FAILED:
            pool.on_worker_failed(handle, header.get("stage"), header.get("message"))
        else:
            logger.warning("%s sent an unknown message type %r", handle.worker_id, kind)

    def _on_sentinel(self, handle: WorkerHandle) -> None:
        """A worker exited. Reap every worker that is dead by now before recovering anyone's
        requests, so a retry never goes to a worker that died at the same moment (killing both
        workers at once must not turn a good request into POISON)."""
        if handle.exitcode is not None or not multiprocessing.connection.wait([handle.sentinel], 0):
            return  # a stale event: this fd was reaped earlier in the pass and reused since
        dead = [handle] + [other for other in self._dead_now() if other is not handle]
        owners = [self.fleet.pool_of(gone) for gone in dead]
        for gone in dead:
            # What it wrote before it died is still in its link: an answer it sent is relayed,
            # not retried as if it had never come.
            self.intake.drain_link(gone)
        for gone in dead:
            self._reap(gone)
        for gone, pool in zip(dead, owners):
            pool.mark_exited(gone)
        for gone, pool in zip(dead, owners):
            pool.on_exit(gone)
        self._report_health()

    def _dead_now(self) -> list[WorkerHandle]:
        ready = multiprocessing.connection.wait(list(self._by_sentinel), timeout=0)
        return [self._by_sentinel[fd] for fd in ready]

    def _reap(self, handle: WorkerHandle) -> None:
        process = handle.process
        process.join(5)  # the sentinel fired: it has exited or is about to be reapable
        if process.exitcode is None:
            logger.error("%s pid %s closed its sentinel but did not exit; killing",
                         handle.worker_id, handle.pid)
            handle.signal(signal.SIGKILL)
            process.join()
        handle.exitcode = process.exitcode
        self._off(handle.sentinel)
        self._by_sentinel.pop(handle.sentinel, None)
        process.close()  # frees the sentinel fd: a long-lived daemon restarts many workers
        self.link_closed(handle)
        handle.link.close()
        handle.buffer_socket.close()
        handle.buffers.clear()

    def link_closed(self, handle: WorkerHandle) -> None:
        """``handle``'s link is done, and is read no more. The worker closed it: it is exiting,
        and its sentinel says the rest (one that closed it and lives on stops beating, and is
        killed as hung). Or it wrote what is no link frame: nothing it says can be read any
        more, so it is killed now and what it held is retried (its slot restarts)."""
        link = handle.link
        if link.fd in self._watched_links:
            self._watched_links.discard(link.fd)
            self._off(link.fd)
        if link.error is None or not handle.alive or _exited(handle):
            return
        logger.error("%s pid %s: %s; killing it", handle.worker_id, handle.pid, link.error)
        pool = self.fleet.pool_of(handle)
        if pool is not None:
            pool.terminate(handle, "garbled link")

    # -- timers -----------------------------------------------------------------------------

    def _tick(self) -> None:
        now = self.clock()
        self.timers.call_at(now + TICK, self._tick)  # first: a failure below must not stop ticks
        for pool in self.pools.values():
            pool.tick(now)
            pool.roll_step()
            self.router.send_due_probes(pool, pool.ready())
            self.router.dispatch(pool)
        self.fleet.tend_leaving(now, self.router)
        self.connections.tick()
        self.router.replies.sweep()
        self._report_health()
        if self.telemetry is not None:
            self.telemetry.publish(self.pools, self.router.queued, self._identities())
        if self.stopping:
            self._shutdown_step(now)

    def _identities(self) -> list[dict]:
        """What each identity holds: the daemon's (supervisor/routing/quotas.py), then the gateway's
        callers (gateway/quota.py), named ``gateway/IDENTITY``."""
        rows = self.quotas.view()
        if self.gateway is not None:
            rows += [{**row, "identity": f"gateway/{row['identity']}"} for row in self.gateway.usage()]
        return rows

    def forget_buffers(self, tokens: list[str]) -> None:
        """Revoked tokens: every worker holding one of them unmaps it."""
        if not tokens:
            return
        revoked = set(tokens)
        for handle in self._by_sentinel.values():
            held = handle.buffers & revoked
            if held:
                handle.buffers -= held
                handle.link.send([protocol.pack({"type": protocol.FORGET, "tokens": sorted(held)})])

    def _watchdog(self) -> None:
        self.notifier.watchdog()
        self.timers.call_at(self.clock() + self.notifier.watchdog_interval, self._watchdog)

    # -- what pools (PoolHost, supervisor/fleet/pool.py) and commands call ------------------------

    def worker_spec(self, config: ModelConfig, slot: int, generation: int,
                    placement: SlotPlacement) -> WorkerSpec:
        daemon = self.settings.daemon
        python_path = self._python_path()
        secret = new_secret()
        return WorkerSpec(model=config, slot=slot, generation=generation, cores=placement.cores,
                          threads=placement.threads, device=placement.device,
                          supervisor_pid=self.pid,
                          base_dir=str(self.settings.base_dir), python_path=python_path,
                          heartbeat_interval=daemon.heartbeat_interval,
                          shm_threshold=daemon.shm_threshold, log_level=daemon.log_level,
                          max_mapped_bytes=self.registry.max_bytes,
                          log_format=daemon.log_format, secret=secret,
                          version=self.versions.of(config))

    def launch(self, spec: WorkerSpec, on_state) -> WorkerHandle:
        # Two private socket pairs, whose child ends spawn duplicates into this worker alone (the
        # supervisor keeps only its own ends): the link every message travels on
        # (shared/link.py), and the SEQPACKET pair that carries buffer descriptors.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        buffers, child_buffers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        process = self._spawn.Process(target=worker_main.run, args=(spec, child_buffers, theirs),
                                      name=f"modelwarden worker {spec.worker_id}")
        try:
            process.start()
        except BaseException:
            buffers.close()
            ours.close()
            raise
        finally:
            child_buffers.close()
            theirs.close()
        buffers.setblocking(False)
        # No message of a worker's can be larger than what the daemon would let wait unread for
        # its clients: anything larger is garbage from a broken worker, refused by its length.
        link = Link(ours, max_bytes=self.settings.daemon.max_unread_bytes)
        link.on_pending = functools.partial(self.loop.poller.want_write, link.fd)
        now = self.clock()
        handle = WorkerHandle(spec, process, process.pid, process.sentinel, started_at=now,
                              on_state=on_state, last_seen=now, buffer_socket=buffers, link=link)
        self._by_sentinel[process.sentinel] = handle
        self._on(process.sentinel, functools.partial(self._on_sentinel, handle))
        self._watched_links.add(link.fd)
        self._on(link.fd, functools.partial(self.intake.drain_link, handle))
        logger.info("%s: spawned pid %d on %s, version %s", spec.worker_id, process.pid,
                    spec.placement, spec.version)
        return handle

    def send_stop(self, handle: WorkerHandle) -> None:
        handle.link.send([protocol.pack({"type": protocol.STOP})])

    def signal_worker(self, handle: WorkerHandle, signum: int) -> None:
        handle.signal(signum)

    def standby_placement(self, pool: ModelPool, template: SlotPlacement) -> SlotPlacement:
        return placement_for(template, available_cores(), self.fleet.claimed_cores())

    def send_promote(self, handle: WorkerHandle) -> None:
        spec = handle.spec
        handle.link.send([protocol.pack(
            {"type": protocol.PROMOTE, "slot": spec.slot, "generation": spec.generation,
             "cores": list(spec.cores), "threads": spec.threads})])

    def on_worker_ready(self, pool: ModelPool) -> None:
        self.router.dispatch(pool)

    def recover_requests(self, pool: ModelPool, handle: WorkerHandle) -> None:
        self.router.recover(pool, handle)

    def on_slot_fatal(self, pool: ModelPool) -> None:
        # A removed pool's queue may belong by now to a model of the same name added since.
        if pool.all_fatal() and self.pools.get(pool.name) is pool:
            self.router.fail_queue(pool, NO_WORKER,
                                   f"every worker of {pool.name!r} is FATAL or stopped")

    # -- what commands may ask (supervisor/commands.py: CommandHost) ------------------------------

    def status(self) -> dict:
        return status_snapshot(self)

    def restart(self, target: str | None) -> list[str]:
        """Revive FATAL/stopped slots and replace live workers: every model, one model, or one
        worker slot (``mlp#1``)."""
        if self.stopping:
            raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down")
        return self.fleet.restart(target)

    def stop_target(self, target: str) -> list[str]:
        """Drain and stop one model's workers, or one worker slot, until a restart."""
        if self.stopping:
            raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down")
        return self.fleet.stop(target)

    # -- reload and scale (supervisor/fleet/reload.py decides, the pools act) ---------------------

    def reload(self) -> list[str]:
        """Re-read the configuration file and apply what changed; refused as a whole (the
        running configuration untouched) when the new one is invalid."""
        if self.stopping:
            raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down")
        if self.zap is not None:  # rotated client keys apply whatever the file says
            self.zap.reload()
        self.service.reload_started(daemon_health(self.pools.values()))
        try:
            new = load_settings(self.settings.config_path)
            placements = plan(new, keep=self.fleet.running_placements())
            reload.check_daemon_unchanged(self.settings, new)
        except ConfigError as exc:
            self._report_health()  # nothing changed: READY=1 closes the RELOADING=1
            logger.error("reload refused, the running configuration stays: %s", exc)
            raise ProtocolError(BAD_REQUEST, f"config error: {exc}; the running configuration "
                                "is unchanged") from None
        return self._apply(new, placements, "reload", release=True)

    def scale(self, name: str, workers: int) -> list[str]:
        """``workers`` slots for one model, until the next reload re-reads the file."""
        if self.stopping:
            raise ProtocolError(SHUTTING_DOWN, "the daemon is shutting down")
        pool = self.pools.get(name)
        if pool is None:
            raise ProtocolError(BAD_REQUEST, f"no model named {name!r}")
        if pool.config.cores is not None or isinstance(pool.config.device, list):
            raise ProtocolError(BAD_REQUEST, f"{name!r} lists its cores or devices worker by "
                                "worker: change 'workers' with them in the file, then reload")
        models = [model.model_copy(update={"workers": workers}) if model.name == name else model
                  for model in self.settings.models]
        new = self.settings.model_copy(update={"models": models})
        try:
            placements = plan(new, keep=self.fleet.running_placements())
        except ConfigError as exc:
            raise ProtocolError(BAD_REQUEST, f"cannot place {workers} worker(s): {exc}") from None
        return self._apply(new, placements, "scale command")

    def _apply(self, new: Settings, placements: dict, why: str, release: bool = False) -> list[str]:
        """``release``: the file was re-read, so slots stopped by a command start again."""
        changes = reload.diff(self.settings, new, self.fleet.running_placements(), placements,
                              self.versions.of, self.fleet.slot_versions())
        try:
            judges = self.fleet.judges_for(new, changes)  # may refuse: nothing is touched yet
        except ProtocolError as exc:
            logger.error("reload refused, the running configuration stays: %s", exc.message)
            self._report_health()
            raise
        self.settings = new
        self._set_shares(new)  # the requests' share follows the models' max_queue
        summary = self.fleet.apply(new, changes, placements, judges, self.versions.of,
                                   self._new_pool, why, release)
        self._report_health()
        return summary

    # -- stopping ---------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        now = self.clock()
        if self.stopping:
            logger.warning("%s again: stopping now", reason)
            self._stop_deadline = now
            self._shutdown_step(now)
            return
        logger.info("%s: draining, then stopping (at most %.0fs)", reason,
                    self.settings.daemon.graceful_timeout)
        self.stopping = True
        self.notifier.stopping()
        self._stop_deadline = now + self.settings.daemon.graceful_timeout
        self._shutdown_step(now)

    def _shutdown_step(self, now: float) -> None:
        """Serve what was accepted; then (or at the deadline) stop every worker."""
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self.router.fail_everything(SHUTTING_DOWN, "the daemon stopped before answering")
            self.fleet.terminate_all("shutdown deadline")
            self._stop_deadline = None
            return
        if self.router.pending or self._workers_told_to_stop:
            return
        self._workers_told_to_stop = True
        self.fleet.shut_down()


def _exited(handle: WorkerHandle) -> bool:
    """The worker's process is gone (its sentinel is ready), reaped or not."""
    return handle.exitcode is not None or bool(multiprocessing.connection.wait([handle.sentinel], 0))
