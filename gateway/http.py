"""The REST half of the gateway: the KServe v2 HTTP/REST API as a Starlette app (uvicorn runs it).

    GET  /v2/health/live                          200 while the gateway serves
    GET  /v2/health/ready                         200 when every model has a READY worker, else 503
    GET  /v2                                      server metadata (name, version, extensions)
    GET  /v2/models/{name}[/versions/{v}]         model metadata
    GET  /v2/models/{name}[/versions/{v}]/ready   200 ready, 503 not ready, 404 unknown
    GET  /v2/models/{name}[/versions/{v}]/config  Triton's model configuration (its extension)
    POST /v2/models/{name}[/versions/{v}]/infer   JSON tensors, or the binary data extension

With a token file (gateway/access.py), every path but the two health checks answers 401
``{"error": "UNAUTHENTICATED: ..."}`` (and ``WWW-Authenticate: Bearer``) to a call without a
valid ``Authorization: Bearer TOKEN``, before anything else is looked at.

Errors are ``{"error": "CODE: message"}`` with the status of ``kserve.HTTP_STATUS``. A body is
bounded before it is read: a Content-Length or an Inference-Header-Content-Length above
``max_message_bytes`` is refused at once (413 / 400), and a chunked body is cut off at the limit.

JSON is bounded apart, by ``max_json_bytes`` (8 MiB by default): the JSON part of a body (all of
it, or the first Inference-Header-Content-Length bytes) over it is refused with 413 before it is
read. A JSON number costs Python about 14 times its text (a float object and a list slot, then
numpy's copy), and ``json.loads`` holds the loop while it runs: 48 MiB of JSON took 670 MiB and
stalled every other call for 4 s. Decoding numbers without Python objects would need a JSON
parser we do not have; a cap keeps the cost of one body at about 110 MiB and 0.6 s, and tensors
of any size within ``max_message_bytes`` still travel as binary data (the binary tensor data
extension, what tritonclient sends by default), which is never parsed.

An infer call counts against its caller's share (gateway/quota.py): the token's name, else the
client certificate's subject, else the peer's address (``uid:N`` on a Unix socket, from
SO_PEERCRED); over it, 429 with ``OVERLOADED: ...`` naming the limit.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelwarden.gateway import access, kserve, quota
from modelwarden.gateway.service import InferenceService, error_of
from modelwarden.shared.protocol import BAD_REQUEST, ProtocolError

logger = logging.getLogger(__name__)

TOO_LARGE = 413
UNAUTHORIZED = 401
TOO_MANY = 429


class BodyTooLarge(Exception):
    """What is over which limit: the caller's 413."""


@dataclass(frozen=True)
class BodyLimits:
    body: int  # max_message_bytes
    json: int  # max_json_bytes

    def too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"the request body exceeds the gateway's max_message_bytes ({self.body})")

    def json_too_large(self, length: int | None) -> BodyTooLarge:
        size = f" ({length} bytes)" if length is not None else ""
        return BodyTooLarge(f"the request's JSON{size} exceeds the gateway's max_json_bytes "
                            f"({self.json}); send large tensors as binary data (the binary tensor "
                            "data extension: Inference-Header-Content-Length and binary_data_size, "
                            "tritonclient's default), bounded by max_message_bytes only")


def make_app(service: InferenceService, max_body: int, gate: access.Gatekeeper | None = None,
             max_json: int | None = None, quotas: quota.Quotas | None = None) -> Starlette:
    limits = BodyLimits(max_body, max_json or max_body)
    quotas = quotas or quota.Quotas(quota.Limits(2**31, 2**62, 1.0))

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        is_ready = await service.ready()
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse(service.server_metadata())

    def model_document(describe):
        """A GET answered by ``describe(name, version)``'s JSON (metadata, configuration)."""
        async def answer(request: Request) -> Response:
            params = request.path_params
            try:
                return JSONResponse(await describe(params["name"], params.get("version")))
            except Exception as exc:
                return error_response(exc)

        return answer

    model_metadata = model_document(service.model_metadata)
    model_config = model_document(service.model_config)

    async def model_ready(request: Request) -> Response:
        params = request.path_params
        try:
            is_ready = await service.model_ready(params["name"], params.get("version"))
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"name": params["name"], "ready": is_ready},
                            status_code=200 if is_ready else 503)

    async def infer(request: Request) -> Response:
        params = request.path_params
        try:
            return await _infer(service, request, params["name"], params.get("version"), limits,
                                quotas)
        except ClientDisconnect:
            return Response(status_code=400)
        except BodyTooLarge as exc:
            return error_response(ProtocolError(BAD_REQUEST, str(exc)), status=TOO_LARGE)
        except Exception as exc:
            return error_response(exc)

    routes = [
        ("/v2/health/live", live, "GET"),
        ("/v2/health/ready", ready, "GET"),
        ("/v2", server_metadata, "GET"),
        ("/v2/models/{name}", model_metadata, "GET"),
        ("/v2/models/{name}/versions/{version}", model_metadata, "GET"),
        ("/v2/models/{name}/ready", model_ready, "GET"),
        ("/v2/models/{name}/versions/{version}/ready", model_ready, "GET"),
        ("/v2/models/{name}/config", model_config, "GET"),
        ("/v2/models/{name}/versions/{version}/config", model_config, "GET"),
        ("/v2/models/{name}/infer", infer, "POST"),
        ("/v2/models/{name}/versions/{version}/infer", infer, "POST"),
    ]
    return Starlette(routes=[
        Route(path, handler if gate is None or path in access.OPEN_PATHS else _guarded(handler, gate),
              methods=[method]) for path, handler, method in routes])


def _guarded(handler, gate: access.Gatekeeper):
    async def answer_callers_with_a_token(request: Request) -> Response:
        request.state.token_name = gate.admits(request.headers.get("authorization"), _peer(request))
        if request.state.token_name is None:
            body = json.dumps({"error": kserve.error_text(
                "UNAUTHENTICATED", "this gateway needs Authorization: Bearer TOKEN, with a token "
                                   "from its token_file")})
            return Response(body, status_code=UNAUTHORIZED, media_type="application/json",
                            headers={"WWW-Authenticate": access.CHALLENGE})
        return await handler(request)

    return answer_callers_with_a_token


def _peer(request: Request) -> str:
    """Where the call comes from: ``uid:N`` on a Unix socket, else ``peer:HOST``."""
    peer = getattr(request.state, "peer", None)
    if peer:
        return peer
    return f"peer:{request.client.host}" if request.client else "peer:unknown"


def _identity(request: Request) -> str:
    return access.identity(getattr(request.state, "token_name", None),
                           getattr(request.state, "client_subject", None), _peer(request))


async def _infer(service: InferenceService, request: Request, name: str, version: str | None,
                 limits: BodyLimits, quotas: quota.Quotas) -> Response:
    body_length = kserve.decimal(request.headers.get("content-length"))
    if body_length is not None and body_length > limits.body:
        raise limits.too_large()
    json_length = kserve.header_length(request.headers.get(kserve.HEADER_LENGTH), body_length,
                                       limits.body)
    json_bound = json_length if json_length is not None else body_length
    if json_bound is not None and json_bound > limits.json:
        raise limits.json_too_large(json_bound)
    with quotas.admit(_identity(request)) as ticket:
        if body_length is not None:
            ticket.charge(body_length)  # before a byte of it is read
        body = await _read_body(request, limits, json_length is None,
                                ticket if body_length is None else None)
        json_part, binary_part = kserve.split_body(body, json_length)
        parsed = kserve.parse_infer_request(kserve.load_json(json_part), binary_part)
        del body, json_part, binary_part  # the tensors hold what they need
        model_version, named = await service.infer(name, version, parsed.inputs, parsed.timeout_s)
    outputs = kserve.select_outputs(named, parsed.outputs)
    content, header_length = kserve.infer_response(name, model_version, parsed, outputs)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})


async def _read_body(request: Request, limits: BodyLimits, all_json: bool,
                     ticket: quota.Ticket | None) -> bytes:
    """The body, cut off at its limit (a chunked one has no length to refuse it by); ``ticket``
    is charged chunk by chunk when the length was not known beforehand."""
    limit = min(limits.body, limits.json) if all_json else limits.body
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise limits.json_too_large(None) if all_json and limit == limits.json else limits.too_large()
        if ticket is not None:
            ticket.charge(len(chunk))
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def guarded_protocol(max_connections: int, read_timeout: float):
    """uvicorn's httptools protocol, bounded: a connection past ``max_connections`` is closed as
    soon as it is made, and one whose request (headers and body) has not wholly arrived within
    ``read_timeout`` of its start or of its previous response is closed.

    uvicorn alone waits for ever on a connection that sends nothing or trickles its headers a
    byte at a time: every such connection holds a file descriptor, and enough of them (from any
    local user, or any peer of a public gateway) leave none for real callers."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    refusals = access.RefusalLog("HTTP connection(s) closed at once (max_connections "
                                 f"{max_connections} reached)")

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        read_deadline = None
        peer: str | None = None  # uid:N on a Unix socket
        client_subject: str | None = None  # the client certificate's, with tls_client_ca

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse()
                return
            self.peer, self.client_subject = _peer_of(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            # what the app reads as request.state: the scope's "state" is this request's copy
            self.scope["state"].update(peer=self.peer, client_subject=self.client_subject)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_complete(self) -> None:
            self._disarm()  # the whole request is in: the model's time is not counted
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own read_timeout

        def _arm(self) -> None:
            self._disarm()
            self.read_deadline = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self.read_deadline is not None:
                self.read_deadline.cancel()
                self.read_deadline = None

        def _too_slow(self) -> None:
            self.read_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def _refuse(self) -> None:
            self.transport.close()
            self.peer = _peer_of(self.transport)[0]
            refusals.refused(self.peer or (f"peer:{self.client[0]}" if self.client else "unknown"))

    return GuardedHttpToolsProtocol


def _peer_of(transport) -> tuple[str | None, str | None]:
    """(``uid:N`` of a Unix socket's peer, the client certificate's subject), each or None."""
    uid = None
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                          struct.calcsize("3i"))
            uid = "uid:%d" % struct.unpack("3i", credentials)[1]
        except OSError:
            pass
    subject = None
    ssl_object = transport.get_extra_info("ssl_object")
    certificate = ssl_object.getpeercert() if ssl_object is not None else None
    if certificate:
        subject = ",".join(f"{key}={value}" for entry in certificate.get("subject", ())
                           for key, value in entry)
    return uid, subject


def error_response(exc: BaseException, status: int | None = None) -> Response:
    code, message = error_of(exc)
    if status is None and isinstance(exc, quota.QuotaExceeded):
        status = TOO_MANY
    body = json.dumps({"error": kserve.error_text(code, message)})
    return Response(body, status_code=status or kserve.http_status(code),
                    media_type="application/json")
