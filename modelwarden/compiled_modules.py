"""Which modules the build compiles (setup.py reads this file with the standard library alone).

The request path: every step a request takes through the supervisor (frames in, header parsed
and checked, queued, batched, dispatched, the reply relayed), and the codec the client and the
worker run per request. Lifecycle, probes, reload, the fleet and commands stay interpreted.
"""

import hashlib
from pathlib import Path

COMPILED: dict[str, str] = {
    # the wire: parsers of untrusted bytes (fuzzed: tests/fuzz/)
    "modelwarden.shared.mpack": "shared/mpack.py",
    "modelwarden.shared.protocol": "shared/protocol.py",
    "modelwarden.shared.descriptors": "shared/descriptors.py",
    "modelwarden.shared.sockets": "shared/sockets.py",
    "modelwarden.shared.link": "shared/link.py",
    "modelwarden.shared.zmtp": "shared/zmtp.py",
    # the supervisor's per-request work
    "modelwarden.supervisor.routing.router": "supervisor/routing/router.py",
    "modelwarden.supervisor.routing.service": "supervisor/routing/service.py",
    "modelwarden.supervisor.routing.batching": "supervisor/routing/batching.py",
    "modelwarden.supervisor.routing.requests": "supervisor/routing/requests.py",
    "modelwarden.supervisor.routing.deadlines": "supervisor/routing/deadlines.py",
    "modelwarden.supervisor.routing.workers": "supervisor/routing/workers.py",
    "modelwarden.supervisor.routing.intake": "supervisor/routing/intake.py",
    "modelwarden.supervisor.routing.identity": "supervisor/routing/identity.py",
    # the loop's round (its policy stays in the Arbiter) and its timers
    "modelwarden.supervisor.eventloop": "supervisor/eventloop.py",
    "modelwarden.supervisor.timers": "supervisor/timers.py",
    # the worker's side of the request path: what the router reads of each worker per request
    "modelwarden.supervisor.fleet.handle": "supervisor/fleet/handle.py",
    "modelwarden.supervisor.fleet.slot": "supervisor/fleet/slot.py",
    "modelwarden.supervisor.routing.limits": "supervisor/routing/limits.py",
    "modelwarden.supervisor.routing.quotas": "supervisor/routing/quotas.py",
    # the codec of the client and the worker
    "modelwarden.shared.codec": "shared/codec.py",
    "modelwarden.client.session": "client/session.py",
    "modelwarden.client.client": "client/client.py",
    "modelwarden.client.connection": "client/connection.py",
    "modelwarden.client.local": "client/local.py",
    "modelwarden.worker.serve": "worker/serve.py",
    "modelwarden.worker.pipeline": "worker/pipeline.py",
}


def sources_of(py: Path) -> list[Path]:
    """What one extension is compiled from: its .py, and every .pxd of the compiled modules (the
    one beside it gives its names C types; the others declare the types and functions it may
    cimport, whose layout its C depends on). A build is fresh while all of them are unchanged."""
    root = py.resolve().parents[len(Path(COMPILED[_module_of(py)]).parts) - 1]
    declarations = sorted(pxd for pxd in (root / path for path in COMPILED.values())
                          for pxd in [pxd.with_suffix(".pxd")] if pxd.exists())
    return [py, *declarations]


def _module_of(py: Path) -> str:
    """The compiled module whose source ``py`` is (by its path's tail)."""
    for name, path in COMPILED.items():
        if py.resolve().as_posix().endswith("/" + path):
            return name
    raise KeyError(f"{py} is not a compiled module's source")


def source_hash(py: Path) -> str:
    digest = hashlib.sha256()
    for path in sources_of(py):
        digest.update(path.read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":  # the Makefile's list of sources to rebuild from
    print(" ".join(sorted({str(path) for py in COMPILED.values() for path in sources_of(Path(py))})))
