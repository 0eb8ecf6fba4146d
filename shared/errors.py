"""The errors a request can end in: one RemoteError subclass per protocol error code."""

from __future__ import annotations

from typing import Any

from modelwarden.shared import protocol


class NoDaemon(ConnectionError):
    """Nothing at an endpoint's path or runtime directory: no daemon runs there. Raised on the
    client's side before anything is sent (client/ipcaccess.py, shared/trustdir.py)."""


class ConnectionLost(ConnectionError):
    """The daemon closed a ``unix://`` connection while this request waited for its reply (it
    stopped or restarted): it will not be answered, and whether it ran is unknown. Raised at
    once, where a ZeroMQ endpoint's request would wait for its deadline and raise Timeout."""


class RemoteError(Exception):
    """A request failed; ``code`` is one of shared.protocol.ERROR_CODES."""

    code = "REMOTE_ERROR"

    def __init__(self, message: str, request_id: Any = None, worker: str | None = None) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message
        self.request_id = request_id
        self.worker = worker


def _error_class(code: str, base: type[RemoteError] = RemoteError) -> type[RemoteError]:
    name = "".join(part.title() for part in code.split("_"))
    return type(name, (base,), {"code": code, "__doc__": protocol.ERROR_CODES[code]})


BadRequest = _error_class(protocol.BAD_REQUEST)
BadInput = _error_class(protocol.BAD_INPUT)
UnknownModel = _error_class(protocol.UNKNOWN_MODEL)
NoWorker = _error_class(protocol.NO_WORKER)
ModelError = _error_class(protocol.MODEL_ERROR)
# A model failure of its own kind: ``except ModelError`` catches it too.
OutOfMemory = _error_class(protocol.OUT_OF_MEMORY, ModelError)
WorkerDied = _error_class(protocol.WORKER_DIED)
Poison = _error_class(protocol.POISON)
Timeout = _error_class(protocol.TIMEOUT)
Overloaded = _error_class(protocol.OVERLOADED)
ShuttingDown = _error_class(protocol.SHUTTING_DOWN)
InternalError = _error_class(protocol.INTERNAL)

ERRORS: dict[str, type[RemoteError]] = {
    cls.code: cls for cls in (BadRequest, BadInput, UnknownModel, NoWorker, ModelError, OutOfMemory,
                              WorkerDied, Poison, Timeout, Overloaded, ShuttingDown, InternalError)}


def error_from_reply(header: dict) -> RemoteError:
    error = header.get("error") or {}
    cls = ERRORS.get(error.get("code"), RemoteError)
    return cls(str(error.get("message", "")), header.get("id"), header.get("worker"))
