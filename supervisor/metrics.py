"""Prometheus metrics, ``/healthz`` and ``/readyz`` (``[daemon] metrics = "HOST:PORT"``).

Every number is the loop's own and is handed to the scrape in one immutable ``Snapshot``:

* Per request (the router calls ``RequestMetrics.answered`` once per answer, from the loop):
  ``modelwarden_requests_total{model,version,code}`` and the latency and batch-size
  histograms, kept as plain counts the loop alone writes (a bisect and two additions per
  histogram: no lock on the hot path).
* Per tick (``Telemetry.publish``, every 0.1 s): workers and slots by state, FATAL slots, queue
  depth, RSS and CUDA memory, restarts by cause and probe failures read from the pools, and a
  copy of the per-request counts. The snapshot replaces the previous one with one assignment;
  the scrape's collector reads only the snapshot, so it never sees a dict the loop is in the
  middle of changing. Counters may be up to one tick behind the last answer.

The HTTP side is supervisor/metrics_http.py, served from the loop itself (no thread, a bounded
number of connections, a read timeout). A scrape renders the latest snapshot with
prometheus_client's own encoder (the collector reads only the snapshot), once per snapshot and
format: scrapes of the same tick's snapshot share one page. ``/healthz`` answers 200
while the loop publishes (a loop stuck for ``STALE_AFTER`` seconds turns it to 503; a loop that
is stuck answers nothing at all, which a probe's timeout reads the same way); ``/readyz``
answers 200 only when every model has its minimum of READY workers, else 503.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder, gzip_accepted

from modelwarden.shared.states import SlotState, WorkerState
from modelwarden.supervisor.metrics_http import HttpServer, Request, Response
from modelwarden.supervisor.routing.quotas import RESOURCES
from modelwarden.shared.process import DaemonError

logger = logging.getLogger(__name__)

STALE_AFTER = 10.0  # seconds without a published snapshot before /healthz says the loop is stuck
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The labels of modelwarden_requests_total, in order. ``request_labels`` returns their values: a
# new label (a model version) is one name here and one value there.
REQUEST_LABELS = ("model", "version", "code")
# name, help, bucket bounds: one histogram of each per model, in RequestMetrics.answered's order.
HISTOGRAMS = (
    ("modelwarden_queue_seconds", "Time from acceptance to dispatch, successful requests",
     LATENCY_BUCKETS),
    ("modelwarden_compute_seconds", "The forward pass that served the request (the whole "
     "batch's), successful requests", LATENCY_BUCKETS),
    ("modelwarden_request_seconds", "Time from acceptance to the reply, successful requests",
     LATENCY_BUCKETS),
    ("modelwarden_batch_size", "Requests in the forward pass that served each successful request",
     BATCH_BUCKETS),
)


def request_labels(request, code: str) -> tuple:
    """The version is the one of the worker that answered; "" for a request answered before
    any worker held it (refused at intake, timed out in the queue)."""
    worker = getattr(request, "worker", None)
    return (request.model, worker.spec.version if worker is not None else "", code)


# -- per request (the loop's hot path) -----------------------------------------------------------


class _Histogram:
    """Counts per bucket (not cumulative: one addition per observation), their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le is inclusive
        self.sum += value

    def frozen(self) -> tuple:
        return tuple(self.counts), self.sum


class RequestMetrics:
    """What the router's answers add up to; written by the loop only."""

    def __init__(self) -> None:
        self.requests: collections.Counter = collections.Counter()  # request_labels -> answers
        self.histograms: dict[str, tuple] = {}  # model -> one _Histogram per HISTOGRAMS entry

    def answered(self, request, code: str, timing: dict | None) -> None:
        self.requests[request_labels(request, code)] += 1
        if timing is None:
            return
        histograms = self.histograms.get(request.model)
        if histograms is None:
            histograms = self.histograms[request.model] = tuple(
                _Histogram(bounds) for _, _, bounds in HISTOGRAMS)
        queue, compute, total, batch = histograms
        queue.observe(timing["queue_us"] / 1e6)
        if timing.get("compute_us") is not None:
            compute.observe(timing["compute_us"] / 1e6)
        total.observe(timing["total_us"] / 1e6)
        batch.observe(timing.get("batch") or 1)

    def frozen(self) -> tuple[tuple, tuple]:
        return (tuple(self.requests.items()),
                tuple((model, tuple(h.frozen() for h in histograms))
                      for model, histograms in self.histograms.items()))


# -- per tick (published by the loop, read by the scrape) ---------------------------------


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic() when the loop published it
    ready: bool  # every model has its minimum of READY workers
    workers: tuple = ()  # (model, worker state, count)
    slots: tuple = ()  # (model, slot state, count)
    queued: tuple = ()  # (model, requests waiting for a worker)
    ready_workers: tuple = ()  # (model, READY slots, the minimum)
    memory: tuple = ()  # (model, worker id, pid, rss bytes or None, cuda bytes or None)
    restarts: tuple = ()  # (model, cause, total since start)
    probe_failures: tuple = ()  # (model, total since start)
    promotions: tuple = ()  # (model, standbys promoted into a slot since start)
    requests: tuple = ()  # (request_labels, answers)
    histograms: tuple = ()  # (model, ((bucket counts, sum) per HISTOGRAMS entry))
    identities: tuple = ()  # (identity, resource, held): supervisor/routing/quotas.py, largest holders


def minimum_ready(pool) -> int:
    """READY workers a model needs to count as serving: ``[[models]] ready_min`` where the
    configuration has that key (the systemd readiness work adds it), else all of its slots, so
    /readyz and systemd's READY=1 make the same promise."""
    ready_min = getattr(pool.config, "ready_min", None)
    return len(pool.slots) if ready_min is None else ready_min


def restart_cause(text: str) -> str:
    """A bounded label from a slot's cause text: "SIGKILL", "exit 4 (model load error)",
    "replaced" (for every "replaced: ..." reason)."""
    return text.split(":", 1)[0].strip() or "unknown"


@dataclass
class _Totals:
    """Monotone totals the pools keep only per incarnation (a slot's ``restarts`` and its
    recent ``causes``; a worker's probe ``failures``), summed here so they never go back."""

    restarts: collections.Counter = field(default_factory=collections.Counter)  # (model, cause)
    probe_failures: collections.Counter = field(default_factory=collections.Counter)  # model
    promotions: collections.Counter = field(default_factory=collections.Counter)  # model
    _promotions_seen: dict = field(default_factory=dict)  # slot name -> slot.promotions counted
    _restarts_seen: dict = field(default_factory=dict)  # slot name -> slot.restarts counted
    _probes_seen: dict = field(default_factory=dict)  # (worker id, pid) -> failures counted

    def count(self, pools) -> None:
        live = {}
        for pool in pools:
            for slot in pool.slots:
                self._count_restarts(pool.name, slot)
                self.promotions[pool.name] += max(
                    0, slot.promotions - self._promotions_seen.get(slot.name, 0))
                self._promotions_seen[slot.name] = slot.promotions
                for handle in slot.handles():
                    key = (handle.worker_id, handle.pid)
                    live[key] = failures = handle.probe.failures
                    self.probe_failures[pool.name] += failures - self._probes_seen.get(key, 0)
        self._probes_seen = live

    def _count_restarts(self, model: str, slot) -> None:
        new = slot.restarts - self._restarts_seen.get(slot.name, 0)
        if new <= 0:
            return
        self._restarts_seen[slot.name] = slot.restarts
        recent = list(slot.causes)[-new:]
        for _, cause in recent:
            self.restarts[(model, restart_cause(cause))] += 1
        self.restarts[(model, "unknown")] += new - len(recent)  # older than the kept causes


class Telemetry:
    """The loop's side: publish a snapshot each tick; the collector serves the latest one."""

    def __init__(self, registry: CollectorRegistry, clock=time.monotonic) -> None:
        self.clock = clock
        self.snapshot = Snapshot(at=clock(), ready=False)
        self.requests = RequestMetrics()
        self._totals = _Totals()
        registry.register(_SnapshotCollector(self))

    def publish(self, pools: dict, queued, identities: list | None = None) -> None:
        """``queued(pool)``: how many requests wait for that pool (the router's queue);
        ``identities``: what each identity holds (``Quotas.view()``)."""
        pools = list(pools.values())
        self._totals.count(pools)
        requests, histograms = self.requests.frozen()
        ready_workers = tuple((pool.name, pool.ready_count(), minimum_ready(pool)) for pool in pools)
        self.snapshot = Snapshot(
            at=self.clock(),
            ready=all(ready >= need for _, ready, need in ready_workers),
            workers=_by_state(pools, lambda pool: pool.handles(), WorkerState),
            slots=_by_state(pools, lambda pool: pool.slots, SlotState),
            queued=tuple((pool.name, queued(pool)) for pool in pools),
            ready_workers=ready_workers,
            memory=tuple((pool.name, handle.worker_id, handle.pid, handle.rss_bytes, handle.cuda_bytes)
                         for pool in pools for handle in pool.handles() if handle.alive),
            restarts=tuple((model, cause, n) for (model, cause), n in self._totals.restarts.items()),
            probe_failures=tuple(self._totals.probe_failures.items()),
            promotions=tuple(self._totals.promotions.items()),
            requests=requests, histograms=histograms,
            identities=tuple((row["identity"], resource, row[resource]) for row in identities or ()
                             for resource in RESOURCES if row.get(resource)))

    def live(self) -> bool:
        return self.clock() - self.snapshot.at < STALE_AFTER


def _by_state(pools: list, items, states) -> tuple:
    rows = []
    for pool in pools:
        counts = collections.Counter(item.state for item in items(pool))
        rows.extend((pool.name, state.value, counts.get(state, 0)) for state in states)
    return tuple(rows)


class _SnapshotCollector:
    """Reads ``Telemetry.snapshot`` once per scrape (one attribute read: the whole of it or the
    previous whole of it, never half of each)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def collect(self):
        snap = self.telemetry.snapshot
        yield _gauge("modelwarden_workers", "Worker processes by model and state",
                     ["model", "state"], (((m, s), n) for m, s, n in snap.workers))
        yield _gauge("modelwarden_slots", "Worker slots by model and state (FATAL: given up on)",
                     ["model", "state"], (((m, s), n) for m, s, n in snap.slots))
        yield _gauge("modelwarden_fatal_slots", "Slots that are FATAL (alert when > 0)", ["model"],
                     (((m,), n) for m, s, n in snap.slots if s == SlotState.FATAL.value))
        yield _gauge("modelwarden_ready_workers", "Slots with a READY worker", ["model"],
                     (((m,), ready) for m, ready, _ in snap.ready_workers))
        yield _gauge("modelwarden_ready_workers_min", "READY workers the model needs to be ready",
                     ["model"], (((m,), need) for m, _, need in snap.ready_workers))
        yield _gauge("modelwarden_queue_depth", "Requests waiting for a worker", ["model"],
                     (((m,), n) for m, n in snap.queued))
        yield _gauge("modelwarden_worker_rss_bytes", "Resident memory of each worker process",
                     ["model", "worker", "pid"],
                     (((m, w, str(pid)), rss) for m, w, pid, rss, _ in snap.memory if rss is not None))
        yield _gauge("modelwarden_worker_cuda_bytes", "CUDA memory each worker reports",
                     ["model", "worker", "pid"],
                     (((m, w, str(pid)), cuda) for m, w, pid, _, cuda in snap.memory if cuda is not None))
        restarts = CounterMetricFamily("modelwarden_restarts", "Worker restarts and replacements "
                                       "by cause", labels=["model", "cause"])
        for model, cause, n in snap.restarts:
            restarts.add_metric([model, cause], n)
        yield restarts
        promotions = CounterMetricFamily("modelwarden_promotions", "Standby workers promoted "
                                         "into a slot", labels=["model"])
        for model, n in snap.promotions:
            promotions.add_metric([model], n)
        yield promotions
        probes = CounterMetricFamily("modelwarden_probe_failures", "Failed health probes",
                                     labels=["model"])
        for model, n in snap.probe_failures:
            probes.add_metric([model], n)
        yield probes
        requests = CounterMetricFamily("modelwarden_requests", "Requests answered, by model and "
                                       "reply code (ok or the error code)", labels=list(REQUEST_LABELS))
        for labels, n in snap.requests:
            requests.add_metric(list(labels), n)
        yield requests
        yield from _histograms(snap.histograms)
        yield _gauge("modelwarden_identity_held", "What each identity (uid:N, key:NAME, addr:IP; "
                     "gateway/token:ID, gateway/cert:..., gateway/peer:... at the gateway) holds "
                     "now, against its share: connections, buffers, buffer_bytes, requests, "
                     "request_bytes (the largest holders)", ["identity", "resource"],
                     (((who, resource), n) for who, resource, n in snap.identities))
        yield GaugeMetricFamily("modelwarden_ready", "1 when every model has its minimum of READY "
                                "workers", value=int(snap.ready))


def _histograms(rows: tuple):
    families = [HistogramMetricFamily(name, documentation, labels=["model"])
                for name, documentation, _ in HISTOGRAMS]
    for model, frozen in rows:
        for family, (_, _, bounds), (counts, total) in zip(families, HISTOGRAMS, frozen):
            cumulative, buckets = 0, []
            for bound, count in zip((*bounds, float("inf")), counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            family.add_metric([model], buckets, sum_value=total)
    return families


def _gauge(name: str, documentation: str, labels: list, rows) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


# -- what the HTTP side answers (supervisor/metrics_http.py serves it from the loop) ------------


class MetricsApp:
    """``/metrics`` (and ``/``), ``/healthz``, ``/readyz``: prometheus_client's own page, one
    render of the published snapshot per scrape."""

    def __init__(self, registry: CollectorRegistry, telemetry: Telemetry) -> None:
        self.registry = registry
        self.telemetry = telemetry
        self._rendered_for: Snapshot | None = None  # the snapshot the cached pages were made from
        self._rendered: dict[tuple, Response] = {}  # (content type, names, gzip) -> its page

    def __call__(self, request: Request) -> Response:
        if request.path == "/healthz":
            return _plain(self.telemetry.live(), "loop running", "loop stuck")
        if request.path == "/readyz":
            ready = self.telemetry.live() and self.telemetry.snapshot.ready
            return _plain(ready, "ready", "not ready: a model lacks READY workers")
        if request.path in ("/metrics", "/"):
            return self._metrics(request)
        return Response(404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n")

    def _metrics(self, request: Request) -> Response:
        """What prometheus_client's WSGI app answers: OPTIONS and GET, the format the Accept
        header asks for, ``name[]`` to restrict, gzip when accepted."""
        allow = (("Allow", "OPTIONS,GET"),)
        if request.method == "OPTIONS":
            return Response(200, "text/plain", b"", allow)
        if request.method not in ("GET", "HEAD"):
            return Response(405, "text/plain",
                            f"# HTTP 405 Method Not Allowed: {request.method[:16]}; use OPTIONS or GET\n"
                            .encode(), allow)
        encoder, content_type = choose_encoder(request.headers.get("accept"))
        names = tuple(request.query.get("name[]", ()))
        gzipped = gzip_accepted(request.headers.get("accept-encoding"))
        key = (content_type, names, gzipped)
        if self._rendered_for is not self.telemetry.snapshot:
            self._rendered_for, self._rendered = self.telemetry.snapshot, {}
        response = self._rendered.get(key)
        if response is None:
            # The render runs in the loop (a few ms for a page of a few models): the same
            # snapshot is rendered once per format, however often peers scrape it.
            response = self._rendered[key] = self._render(encoder, content_type, names, gzipped)
        return response

    def _render(self, encoder, content_type: str, names: tuple, gzipped: bool) -> Response:
        registry = self.registry.restricted_registry(list(names)) if names else self.registry
        body = encoder(registry)
        if gzipped:  # level 1: in the loop; the page shrinks about as much as at level 9
            return Response(200, content_type, gzip.compress(body, compresslevel=1),
                            (("Content-Encoding", "gzip"),))
        return Response(200, content_type, body)


def _plain(ok: bool, yes: str, no: str) -> Response:
    return Response(200 if ok else 503, "text/plain", (yes if ok else no).encode() + b"\n")


def start(address: str, router, *, watch, unwatch, call_at, cancel, clock,
          guard) -> tuple[Telemetry, HttpServer]:
    """Count every answer the router gives and serve the numbers at ``address`` from the loop
    (the callbacks are the host's poller, timers, clock and descriptor account: see
    supervisor/metrics_http.py)."""
    registry = CollectorRegistry()
    telemetry = Telemetry(registry, clock)
    router.observers.append(telemetry.requests.answered)
    server = HttpServer(address, MetricsApp(registry, telemetry), watch=watch, unwatch=unwatch,
                        call_at=call_at, cancel=cancel, clock=clock, guard=guard)
    try:
        server.listen()
    except OSError as exc:
        raise DaemonError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from None
    host = f"[{server.host}]" if ":" in server.host else server.host
    logger.info("metrics on http://%s:%d/metrics (and /healthz, /readyz)", host, server.port)
    return telemetry, server
