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
"""

from __future__ import annotations

import json
import logging

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelwarden.gateway import access, kserve
from modelwarden.gateway.service import InferenceService, error_of
from modelwarden.shared.protocol import BAD_REQUEST, ProtocolError

logger = logging.getLogger(__name__)

TOO_LARGE = 413
UNAUTHORIZED = 401
REFUSALS_LOGGED_EVERY_S = 60.0


class BodyTooLarge(Exception):
    pass


def make_app(service: InferenceService, max_body: int,
             gate: access.Gatekeeper | None = None) -> Starlette:
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
            return await _infer(service, request, params["name"], params.get("version"), max_body)
        except ClientDisconnect:
            return Response(status_code=400)
        except BodyTooLarge:
            return error_response(ProtocolError(BAD_REQUEST, f"the request body exceeds the "
                                                f"gateway's max_message_bytes ({max_body})"),
                                  status=TOO_LARGE)
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
        if not gate.allows(request.headers.get("authorization")):
            body = json.dumps({"error": kserve.error_text(
                "UNAUTHENTICATED", "this gateway needs Authorization: Bearer TOKEN, with a token "
                                   "from its token_file")})
            return Response(body, status_code=UNAUTHORIZED, media_type="application/json",
                            headers={"WWW-Authenticate": access.CHALLENGE})
        return await handler(request)

    return answer_callers_with_a_token


async def _infer(service: InferenceService, request: Request, name: str, version: str | None,
                 max_body: int) -> Response:
    declared = request.headers.get("content-length")
    body_length = int(declared) if declared is not None and declared.isdigit() else None
    if body_length is not None and body_length > max_body:
        raise BodyTooLarge()
    json_length = kserve.header_length(request.headers.get(kserve.HEADER_LENGTH), body_length,
                                       max_body)
    body = await _read_body(request, max_body)
    json_part, binary_part = kserve.split_body(body, json_length)
    parsed = kserve.parse_infer_request(kserve.load_json(json_part), binary_part)
    model_version, named = await service.infer(name, version, parsed.inputs, parsed.timeout_s)
    outputs = kserve.select_outputs(named, parsed.outputs)
    content, header_length = kserve.infer_response(name, model_version, parsed, outputs)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
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

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        refused = 0
        refusals_logged_at = float("-inf")
        read_deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse()
                return
            self._arm()

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
            cls = GuardedHttpToolsProtocol
            cls.refused += 1
            now = self.loop.time()
            if now - cls.refusals_logged_at >= REFUSALS_LOGGED_EVERY_S:
                logger.warning("gateway: %d HTTP connection(s) closed at once: %d open, "
                               "max_connections %d", cls.refused, len(self.connections) - 1,
                               max_connections)
                cls.refused, cls.refusals_logged_at = 0, now

    return GuardedHttpToolsProtocol


def error_response(exc: BaseException, status: int | None = None) -> Response:
    code, message = error_of(exc)
    body = json.dumps({"error": kserve.error_text(code, message)})
    return Response(body, status_code=status or kserve.http_status(code),
                    media_type="application/json")
