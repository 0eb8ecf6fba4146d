"""The gRPC half of the gateway: ``inference.GRPCInferenceService`` (gateway/proto) on grpc.aio.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer, and Triton's
ModelConfig (what perf_analyzer asks first; kserve.model_config says what it reports). Inputs come
as ``raw_input_contents`` (one entry per input, what Triton's client sends) or as typed
``contents`` (BYTES: ``bytes_contents``, or raw as the 4-byte little-endian length prefixes
each element followed by its bytes); outputs always go back as ``raw_output_contents``. Errors abort the call with the
status of ``kserve.GRPC_STATUS`` and the text ``CODE: message``. With a token file
(gateway/access.py), every method but ServerLive and ServerReady aborts UNAUTHENTICATED a call
without a valid ``authorization: Bearer TOKEN`` in its metadata *before its message is read*:
each method is served by a request-streaming handler (``_handler``), which grpc.aio calls
with the metadata alone and which pulls the one message itself, after the token and the
caller's share (gateway/quota.py; RESOURCE_EXHAUSTED over it). A unary handler would be called
only once grpc had received and parsed the whole message (four unauthenticated 200 MiB calls
took the gateway from 254 to 2,037 MiB). Messages are bounded by ``max_message_bytes`` in both
directions (grpc refuses a larger one with RESOURCE_EXHAUSTED as it arrives). On the wire
every method is still the .proto's unary one.
"""

from __future__ import annotations

import logging
import math

import grpc
import numpy as np
import torch

from modelwarden.gateway import access, kserve, quota
from modelwarden.gateway.proto import grpc_predict_v2_pb2 as pb
from modelwarden.gateway.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from modelwarden.gateway.service import InferenceService, error_of
from modelwarden.shared import protocol

logger = logging.getLogger(__name__)

# typed contents: the InferTensorContents field each datatype travels in
_CONTENTS_FIELD = {"BOOL": "bool_contents", "UINT8": "uint_contents", "INT8": "int_contents",
                   "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=await self.service.ready())

    async def ModelReady(self, request, context):
        try:
            ready = await self.service.model_ready(request.name, request.version or None)
        except Exception as exc:
            await _abort(context, exc)
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.service.server_metadata())

    async def ModelMetadata(self, request, context):
        try:
            metadata = await self.service.model_metadata(request.name, request.version or None)
        except Exception as exc:
            await _abort(context, exc)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=metadata["name"], versions=metadata["versions"], platform=metadata["platform"],
            inputs=[tensor(**item) for item in metadata["inputs"]],
            outputs=[tensor(**item) for item in metadata["outputs"]])

    async def ModelConfig(self, request, context):
        try:
            config = await self.service.model_config(request.name, request.version or None)
        except Exception as exc:
            await _abort(context, exc)
        return pb.ModelConfigResponse(config=_config_message(config))

    async def ModelInfer(self, request, context):
        try:
            inputs = decode_inputs(request)
            timeout = kserve.timeout_seconds(_parameter(request.parameters, "timeout"))
            version, named = await self.service.infer(request.model_name,
                                                      request.model_version or None, inputs, timeout)
            wanted = [output.name for output in request.outputs] or None
            outputs = kserve.select_outputs(named, wanted)
            return encode_response(request, version, outputs)
        except Exception as exc:
            await _abort(context, exc)


def _config_message(config: dict) -> "pb.ModelConfig":
    def tensors(kind, items):
        return [kind(name=item["name"], data_type=pb.DataType.Value(item["data_type"]),
                     dims=item["dims"]) for item in items]

    message = pb.ModelConfig(name=config["name"], platform=config["platform"],
                             backend=config["backend"], max_batch_size=config["max_batch_size"],
                             input=tensors(pb.ModelInput, config["input"]),
                             output=tensors(pb.ModelOutput, config["output"]))
    if "dynamic_batching" in config:
        message.dynamic_batching.max_queue_delay_microseconds = \
            config["dynamic_batching"]["max_queue_delay_microseconds"]
    return message


async def _abort(context, exc: BaseException) -> None:
    code, message = error_of(exc)
    status = ("RESOURCE_EXHAUSTED" if isinstance(exc, quota.QuotaExceeded)
              else kserve.grpc_status(code))
    await context.abort(getattr(grpc.StatusCode, status), kserve.error_text(code, message))


def _parameter(parameters, key: str):
    if key not in parameters:
        return None
    value = parameters[key]
    choice = value.WhichOneof("parameter_choice")
    return getattr(value, choice) if choice else None


def decode_inputs(request) -> list[kserve.InferInput]:
    if not request.inputs:
        raise kserve.bad_request("the request has no inputs")
    if len(request.inputs) > protocol.MAX_TENSORS:
        raise kserve.bad_request(f"at most {protocol.MAX_TENSORS} inputs")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise kserve.bad_input(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    decoded = []
    for index, item in enumerate(request.inputs):
        name = item.name
        datatype = kserve.check_datatype(name, item.datatype)
        shape = kserve.check_shape(name, list(item.shape))
        if raw:
            tensor = kserve.raw_tensor(name, datatype, shape, raw[index])
        else:
            tensor = _typed_tensor(name, datatype, shape, item.contents)
        decoded.append(kserve.InferInput(name, datatype, shape, tensor))
    if len({item.name for item in decoded}) != len(decoded):
        raise kserve.bad_input("two inputs have the same name")
    return decoded


def _typed_tensor(name: str, datatype: str, shape: tuple[int, ...], contents) -> torch.Tensor:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise kserve.bad_input(f"input {name!r}: {datatype} travels only as raw_input_contents")
    if datatype == kserve.BYTES:
        kserve.check_element_count(name, shape)  # before the values are looked at
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise kserve.bad_input(f"input {name!r}: {len(values)} values in contents.{field}, but "
                               f"shape {list(shape)} holds {count}")
    if datatype == kserve.BYTES:
        return kserve.listed_elements(name, shape, list(values))
    try:
        array = np.array(values, dtype=kserve.DATATYPES[datatype]).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise kserve.bad_input(f"input {name!r}: a value does not fit {datatype} ({exc})") from None
    return torch.from_numpy(array)


def encode_response(request, version: str, outputs: list) -> "pb.ModelInferResponse":
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=version,
                                     id=request.id)
    for name, tensor in outputs:
        response.outputs.add(name=name, datatype=kserve.tensor_datatype(tensor),
                             shape=kserve.shape_of(tensor))
        response.raw_output_contents.append(bytes(kserve.tensor_bytes(tensor)))
    return response


def make_server(max_message_bytes: int, max_connections: int, read_timeout: float) -> grpc.aio.Server:
    """A server with no service yet: its port can be bound (and fail) before anything else.
    Connections past ``max_connections`` are closed as they come, and one that has not finished
    its handshake (TLS, HTTP/2 preface) within ``read_timeout`` is closed: a peer cannot hold
    file descriptors by connecting and saying nothing."""
    return grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", max(1, int(read_timeout * 1000))),
        # One gateway per port: a second process must fail to bind, not share the port.
        ("grpc.so_reuseport", 0),
    ])


SERVICE = "inference.GRPCInferenceService"
METHODS = {  # name -> (request, response): the .proto's service
    "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
    "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
}


def _parsed(parse, data: bytes):
    # grpc's own handling of a deserializer's exception is UNKNOWN and a traceback in the log
    # for every such message; a malformed message is the caller's error: INVALID_ARGUMENT.
    try:
        return parse(data)
    except Exception as exc:
        raise kserve.bad_request(f"the message is not a valid {SERVICE} request: "
                                 f"{str(exc)[:120]}") from None


class Admission:
    """Who may call and how much: the token gate (None: no token asked) and the quotas."""

    def __init__(self, gate: access.Gatekeeper | None, quotas: quota.Quotas) -> None:
        self.gate = gate
        self.quotas = quotas

    async def identify(self, name: str, context) -> str:
        """The caller's identity, from the call's metadata alone; a call without a valid token
        (when one is asked) is aborted here, its message still unread."""
        peer = _peer(context)
        token_name = None
        if self.gate is not None and name not in access.OPEN_METHODS:
            token_name = self.gate.admits(_authorization(context), peer)
            if token_name is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, kserve.error_text(
                    "UNAUTHENTICATED", "this gateway needs the metadata authorization: Bearer "
                                       "TOKEN, with a token from its token_file"))
        return access.identity(token_name, _client_subject(context), peer)


def _handler(method, name: str, parse, admission: Admission):
    """A call as grpc.aio hands it over *before reading its message*: a request-streaming
    handler is given an iterator it pulls from, where a unary one is called only once the
    whole message has been received and parsed. So the token and the caller's share are
    decided from the metadata first, and the one message is read only then (grpc bounds it by
    grpc.max_receive_message_length on the way in)."""
    async def handle(requests, context):
        identity = await admission.identify(name, context)
        try:
            with admission.quotas.admit(identity) as ticket:
                data = await context.read()
                if not isinstance(data, bytes):  # grpc.aio.EOF: the caller sent no message
                    raise kserve.bad_request("the call carried no message")
                ticket.charge(len(data))
                return await method(_parsed(parse, data), context)
        except protocol.ProtocolError as exc:
            await _abort(context, exc)

    return handle


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


def _peer(context) -> str:
    """``peer:HOST`` of ``ipv4:HOST:PORT`` / ``ipv6:[HOST]:PORT``; ``peer:unix`` on a Unix socket
    (grpc says nothing of the peer's uid there)."""
    peer = context.peer() or ""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return "peer:" + address.rpartition(":")[0].strip("[]")
    return "peer:" + (kind or "unknown")


def _client_subject(context) -> str | None:
    subjects = (context.auth_context() or {}).get("x509_subject")
    return subjects[0].decode("utf-8", "replace") if subjects else None


def add_service(server: grpc.aio.Server, service: InferenceService,
                gate: access.Gatekeeper | None = None, quotas: quota.Quotas | None = None) -> None:
    """The generated ``add_GRPCInferenceServiceServicer_to_server``, but every method reads its
    own message (``_handler``): a caller without a token (when ``gate`` asks for one) is
    answered UNAUTHENTICATED and one over its share RESOURCE_EXHAUSTED before its message is
    read, and a message that does not parse is answered INVALID_ARGUMENT by us, not UNKNOWN by
    grpc. On the wire each is still the .proto's unary method."""
    servicer = InferenceServicer(service)
    admission = Admission(gate, quotas or quota.Quotas(quota.Limits(2**31, 2**62, 1.0)))
    handlers = {name: grpc.stream_unary_rpc_method_handler(
                    _handler(getattr(servicer, name), name, request.FromString, admission),
                    request_deserializer=None, response_serializer=response.SerializeToString)
                for name, (request, response) in METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
