"""The Open Inference Protocol's operations over the daemon: what REST and gRPC both answer.

The gateway is an ordinary client of the daemon's frontend: requests go through one native
``AsyncClient`` (ipc: tensors of ``shm_threshold`` bytes or more travel in shared memory, as for
any local client), so retries, deadlines, batching and every limit are the daemon's own.

What the protocol asks about models (readiness, inputs, outputs, version) comes from the
daemon's ``hello`` offer (docs/PROTOCOL.md): per model its READY workers, declared inputs, its
outputs (declared, or learned from its workers' warm-up), version, batch dimension and default timeout, and whether the daemon is stopping. The
offer is fetched on its own DEALER socket and kept ``CATALOG_TTL_S``: a readiness probe or a
metadata call costs the daemon at most one hello per interval, and each infer reads the cached
entry for its model.

Ready means: the daemon answered, is not stopping, and every model has a READY worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any

import zmq
import zmq.asyncio

from modelwarden.gateway import kserve
from modelwarden.shared import __version__, protocol
from modelwarden.shared.errors import ConnectionLost, InternalError, RemoteError
from modelwarden.shared.protocol import SIGNATURE, UNKNOWN_MODEL, ProtocolError

logger = logging.getLogger(__name__)

CATALOG_TTL_S = 0.5
# Free shared-memory buffers kept between bursts (a few large requests' worth, reused at once);
# more than that, idle for a whole trim interval, go back (gateway/main.py trims every
# BUFFER_TRIM_S). A burst of 16 x 32 MiB otherwise kept 1.1 GB for the process's life.
BUFFERS_KEPT = 64 * 1024 * 1024
HELLO_TIMEOUT_S = 5.0
SERVER_NAME = "modelwarden"
PLATFORM = "pytorch"


class Catalog:
    """The daemon's hello offer, refreshed at most every CATALOG_TTL_S; None when the daemon
    did not answer."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self.context = context
        self.endpoint = endpoint
        self._socket: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._offer: dict | None = None
        self._fetched_at = -CATALOG_TTL_S
        self._lock = asyncio.Lock()

    async def offer(self) -> dict | None:
        if time.monotonic() - self._fetched_at < CATALOG_TTL_S:
            return self._offer
        async with self._lock:  # one fetch at a time; the others read its result
            if time.monotonic() - self._fetched_at >= CATALOG_TTL_S:
                self._offer = await self._hello()
                self._fetched_at = time.monotonic()
        return self._offer

    async def _hello(self) -> dict | None:
        if self._socket is None:
            self._socket = self.context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.endpoint)
        request_id = next(self._ids)
        await self._socket.send_multipart([SIGNATURE, protocol.pack({"type": protocol.CLIENT_HELLO, "id": request_id})])
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if not await self._socket.poll(int(left * 1000)):
                break
            frames = await self._socket.recv_multipart()
            header = _reply_header(frames)
            if header is not None and header.get("id") == request_id:
                return header if header.get("ok") else None
        logger.warning("the daemon did not answer hello within %.0fs", HELLO_TIMEOUT_S)
        # A late answer must not be taken for the next one's: start a fresh socket.
        self._socket.close(0)
        self._socket = None
        return None

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)


def _reply_header(frames: list) -> dict | None:
    try:
        return protocol.split_reply(frames)[0]
    except (InternalError, ProtocolError):
        return None


EXIT_DAEMON_GONE = 75  # EX_TEMPFAIL: the daemon went away under the gateway


class InferenceService:
    def __init__(self, endpoint: str) -> None:
        from modelwarden.client.client import AsyncClient  # torch: only in the gateway process

        self.client = AsyncClient(endpoint)
        self.catalog = Catalog(zmq.asyncio.Context.instance(), endpoint)

    async def close(self) -> None:
        self.catalog.close()
        await self.client.close()

    def trim_buffers(self) -> int:
        """The shared-memory buffers idle since the last call, beyond BUFFERS_KEPT, given back."""
        return self.client.trim_buffers(BUFFERS_KEPT)

    # -- health and metadata ----------------------------------------------------------------

    async def ready(self) -> bool:
        offer = await self.catalog.offer()
        return (offer is not None and not offer.get("stopping")
                and all(model.get("ready", 0) > 0 for model in offer.get("models", [])))

    def server_metadata(self) -> dict:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(kserve.EXTENSIONS)}

    async def model(self, name: str, version: str | None = None) -> dict:
        """The model's hello entry; UNKNOWN_MODEL if there is none (or not that version)."""
        offer = await self.catalog.offer()
        if offer is None:
            raise ProtocolError(protocol.NO_WORKER, "the daemon does not answer")
        entry = next((model for model in offer.get("models", []) if model.get("name") == name), None)
        if entry is None:
            raise ProtocolError(UNKNOWN_MODEL, f"no model named {name[:64]!r}")
        if version and version != entry.get("version"):
            raise ProtocolError(UNKNOWN_MODEL, f"model {name!r} has no version {version[:64]!r}; "
                                f"it serves {entry.get('version')!r}")
        return entry

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        entry = await self.model(name, version)
        return entry.get("ready", 0) > 0

    async def model_metadata(self, name: str, version: str | None = None) -> dict:
        entry = await self.model(name, version)
        batch_dim = entry.get("batch_dim")
        return {"name": name, "versions": [entry.get("version") or ""], "platform": PLATFORM,
                "inputs": kserve.tensor_metadata(entry.get("inputs"), batch_dim),
                "outputs": kserve.tensor_metadata(entry.get("outputs"), batch_dim)}

    async def model_config(self, name: str, version: str | None = None) -> dict:
        return kserve.model_config(name, await self.model(name, version))

    # -- inference --------------------------------------------------------------------------

    async def infer(self, name: str, version: str | None, inputs: list[kserve.InferInput],
                    timeout_s: float | None) -> tuple[str, list[tuple[str, Any]]]:
        """(the model's version, its outputs named); raises ProtocolError or RemoteError."""
        entry = await self.model(name, version)
        arguments = _arguments(entry, inputs)
        timeout = timeout_s if timeout_s is not None else float(entry.get("timeout") or 30.0)
        try:
            result = await self.client.infer(name, arguments, timeout=timeout)
        except ConnectionLost:
            _gone_with_the_daemon()
        flat, keys = kserve.flatten_outputs(result)
        # Learned outputs are named as name_outputs names undeclared ones: only declared ones
        # are held to their count (a model may return fewer than its warm-up did).
        declared = entry.get("outputs") if entry.get("outputs_declared", True) else None
        return entry.get("version") or "", kserve.name_outputs(flat, declared or None, keys)


def _gone_with_the_daemon() -> None:
    """The daemon closed the connection with this request on it: it died or is stopping, and
    this process, its child, dies with it (PR_SET_PDEATHSIG: gateway/main.py) a moment later.
    End now, so that every caller waiting on it sees what it would see then: its connection
    closed with no answer, a request that may have run (docs/SCALING.md), never an INTERNAL
    error. A supervisor still alive restarts the gateway (supervisor/gatewaykeeper.py)."""
    logger.warning("gateway: the daemon closed its connection with requests on it; ending")
    logging.shutdown()
    os._exit(EXIT_DAEMON_GONE)


def _arguments(entry: dict, inputs: list[kserve.InferInput]) -> Any:
    """The model's positional arguments: in its declared order when it declares inputs (the
    names must match), else in the request's order. BYTES inputs are str/bytes elements."""
    specs = entry.get("inputs") or []
    declared = [spec["name"] for spec in specs]
    if declared:
        given = {item.name: item.tensor for item in inputs}
        if sorted(given) != sorted(declared):
            raise kserve.bad_input(f"inputs must be named {declared}, got {[item.name for item in inputs]}")
        # BYTES becomes str where the model declares str (UTF-8 checked here), else bytes
        tensors = [kserve.as_declared(spec["name"], given[spec["name"]], spec.get("dtype"))
                   for spec in specs]
    else:
        tensors = [item.tensor for item in inputs]
    return tensors[0] if len(tensors) == 1 else tensors


def error_of(exc: BaseException) -> tuple[str, str]:
    """(code, message) for what the caller is told: typed errors as they are; anything else is
    INTERNAL with no detail (the traceback goes to the log, never to the caller)."""
    if isinstance(exc, ProtocolError):
        return exc.code, exc.message
    if isinstance(exc, RemoteError):
        return exc.code if exc.code in protocol.ERROR_CODES else protocol.INTERNAL, exc.message
    logger.error("gateway: unexpected error", exc_info=exc)
    return protocol.INTERNAL, "internal error in the gateway; see the daemon's log"
