"""One running worker process, as the supervisor sees it (its blueprint is a WorkerSpec).

Every state change goes through ``set_state``, which checks the edge against the transition table,
logs it and tells the listener (the pool), so no code path can skip a step.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from dataclasses import dataclass, field
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


@dataclass(eq=False, slots=True)
class WorkerHandle:
    spec: WorkerSpec
    process: Any  # multiprocessing.Process (spawn context)
    pid: int
    sentinel: int
    started_at: float
    on_state: Callable[["WorkerHandle", WorkerState, WorkerState], None] | None = None
    state: WorkerState = WorkerState.STARTING
    ready_at: float | None = None  # READY (a standby: STANDBY, until it is promoted and READY)
    promoted_at: float | None = None  # a standby promoted into a slot: when (monotonic)
    last_seen: float = 0.0
    inflight: dict = field(default_factory=dict)  # rid -> Request (probes included)
    served: int = 0
    errors: int = 0
    latencies_us: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW))
    info: dict = field(default_factory=dict)  # what the worker reported: threads, cores, device
    failure: str | None = None  # the worker's own account of why it could not start
    retiring: str | None = None  # why it is being replaced, once a replacement is under way
    rss_bytes: int | None = None
    rss_samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=60))
    cuda_bytes: int | None = None
    request_limit: int | None = None
    probe: ProbeRecord = field(default_factory=ProbeRecord)
    drain_deadline: float | None = None
    stop_sent: bool = False
    last_dispatch: float = 0.0
    kill_timer: Any = None
    exitcode: int | None = None
    buffer_socket: Any = None  # our end of the SEQPACKET pair that carries buffer descriptors
    buffers: set = field(default_factory=set)  # tokens whose descriptors this worker holds
    authenticated: bool = False  # presented its spawn secret (supervisor.workerauth)
    pool: Any = None  # the ModelPool that launched it, and owns it for its whole life

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def identity(self) -> bytes:
        return self.spec.identity

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
