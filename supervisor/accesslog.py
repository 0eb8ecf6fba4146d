"""The access log (``[daemon] access_log = true``): one line per answered request.

Logger ``modelwarden.access``, level INFO whatever ``log_level`` says (the operator asked for it),
through the daemon's usual handler (text or JSON, stderr or the journal). One line::

    rid=17 id=42 model=mlp worker=mlp#0 code=ok queue_us=31 compute_us=210 total_us=262 batch=1

``rid`` is the supervisor's request number (also in the router's error lines), ``id`` the
client's own request id, as a Python literal (``42``, ``'a\\nb'``): a client-chosen string can
carry no newline or spaces into the log to forge a line or a field; ``worker`` is ``-`` for a request answered before any worker took it,
and the timings of an error reply are ``-`` where there is nothing to tell.
"""

from __future__ import annotations

import logging
import time

access = logging.getLogger("modelwarden.access")


def enable() -> None:
    access.setLevel(logging.INFO)


def answered(request, code: str, timing: dict | None) -> None:
    if timing is None:
        timing = error_timing(request)
    worker = request.worker.worker_id if request.worker is not None else "-"
    access.info("rid=%s id=%r model=%s worker=%s code=%s queue_us=%s compute_us=%s total_us=%s batch=%s",
                request.rid, request.client_id, request.model, worker, code,
                _or_dash(timing.get("queue_us")), _or_dash(timing.get("compute_us")),
                _or_dash(timing.get("total_us")), _or_dash(timing.get("batch")))


def error_timing(request) -> dict:
    """What is known of a request answered with an error: how long it was held, and how long it
    waited if a worker took it."""
    now = time.perf_counter_ns()
    dispatched = request.dispatched_ns
    return {"queue_us": (dispatched - request.received_ns) // 1000 if dispatched else None,
            "total_us": (now - request.received_ns) // 1000,
            "batch": request.batch_size if request.worker is not None else None}


def _or_dash(value) -> object:
    return "-" if value is None else value
