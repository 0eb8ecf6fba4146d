"""One running worker process, as the supervisor sees it (its blueprint is a WorkerSpec).

Every state change goes through ``set_state``, which checks the edge against the transition table,
logs it and tells the listener (the pool), so no code path can skip a step.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from typing import TYPE_CHECKING, Any, Callable

from modelwarden.shared.states import ALIVE, EXIT_NAMES, WorkerState, check_transition
from modelwarden.supervisor.fleet.probes import ProbeRecord
from modelwarden.supervisor.routing import workers

if TYPE_CHECKING:  # the status command imports this module and must not pay for pydantic
    from modelwarden.shared.config import WorkerSpec

logger = logging.getLogger(__name__)
_PAGE = os.sysconf("SC_PAGE_SIZE")
LATENCY_WINDOW = 1024


def exit_cause(exitcode: int | None) -> str:
    """multiprocessing's exit code in words: "exit 4 (model load error)", "SIGKILL"."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return EXIT_NAMES.get(exitcode, f"exit {exitcode}")


def read_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class WorkerHandle:
    """Compiled, an extension type whose fields are C slots (handle.pxd): the request path reads
    a worker's state, what it holds in flight and when it was last used, on every request."""

    def __init__(self, spec: "WorkerSpec", process: Any, pid: int, sentinel: int,
                 started_at: float, on_state: Callable | None = None,
                 state: WorkerState = WorkerState.STARTING, last_seen: float = 0.0,
                 buffer_socket: Any = None, link: Any = None) -> None:
        self.spec = spec
        self.process = process  # multiprocessing.Process (spawn context)
        self.pid = pid
        self.sentinel = sentinel
        self.started_at = started_at
        self.on_state = on_state  # (handle, old, new): the pool's listener
        self.state = state
        self.ready_at = None  # READY (a standby: STANDBY, until it is promoted and READY)
        self.promoted_at = None  # a standby promoted into a slot: when (monotonic)
        self.last_seen = last_seen
        self.inflight = {}  # rid -> Request (probes included)
        self.served = 0
        self.errors = 0
        self.latencies_us = collections.deque(maxlen=LATENCY_WINDOW)
        self.info = {}  # what the worker reported: threads, cores, device
        self.failure = None  # the worker's own account of why it could not start
        self.retiring = None  # why it is being replaced, once a replacement is under way
        self.rss_bytes = None
        self.rss_samples = collections.deque(maxlen=60)
        self.cuda_bytes = None
        self.request_limit = None
        self.probe = ProbeRecord()
        self.drain_deadline = None
        self.stop_sent = False
        self.last_dispatch = 0.0
        self.kill_timer = None
        self.exitcode = None
        self.link = link  # our end of its worker link (shared/link.py): every message it and we send
        self.buffer_socket = buffer_socket  # our end of the SEQPACKET pair that carries buffer descriptors
        self.buffers = set()  # tokens whose descriptors this worker holds
        self.authenticated = False  # presented its spawn secret (supervisor.workerauth)
        self.pool = None  # the ModelPool that launched it, and owns it for its whole life

    def __repr__(self) -> str:
        return f"WorkerHandle({self.spec.worker_id}, pid={self.pid}, {self.state.value})"

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def alive(self) -> bool:
        return self.state in ALIVE

    def set_state(self, new: WorkerState, reason: str = "") -> None:
        old = self.state
        check_transition(old, new)
        self.state = new
        level = logging.WARNING if new == WorkerState.DEAD else logging.INFO
        logger.log(level, "%s pid %s: %s -> %s%s", self.worker_id, self.pid, old.value, new.value,
                   f" ({reason})" if reason else "")
        if self.on_state is not None:
            self.on_state(self, old, new)

    def has_room(self, max_inflight: int) -> bool:
        return workers.has_room(self, max_inflight)

    def signal(self, signum: int) -> None:
        if self.exitcode is not None:
            return  # reaped: the pid may belong to someone else by now
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def sample_rss(self, now: float) -> int | None:
        self.rss_bytes = read_rss(self.pid)
        if self.rss_bytes is not None:
            self.rss_samples.append((now, self.rss_bytes))
        return self.rss_bytes

    def rss_trend(self) -> float | None:
        """Bytes per second over the sampled window: a leak shows as a steady positive slope."""
        if len(self.rss_samples) < 2:
            return None
        (t0, r0), (t1, r1) = self.rss_samples[0], self.rss_samples[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else None

    def latency_p50_us(self) -> int | None:
        if not self.latencies_us:
            return None
        ordered = sorted(self.latencies_us)
        return ordered[len(ordered) // 2]
