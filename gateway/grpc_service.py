"""The gRPC half of the gateway: ``inference.GRPCInferenceService`` (gateway/proto) on grpc.aio.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer, and Triton's
ModelConfig (what perf_analyzer asks first; kserve.model_config says what it reports). Inputs come
as ``raw_input_contents`` (one entry per input, what Triton's client sends) or as typed
``contents``; outputs always go back as ``raw_output_contents``. Errors abort the call with the
status of ``kserve.GRPC_STATUS`` and the text ``CODE: message``. With a token file
(gateway/access.py), every method but ServerLive and ServerReady aborts UNAUTHENTICATED a call
without a valid ``authorization: Bearer TOKEN`` in its metadata, before its message is looked at. Messages are bounded by
``max_message_bytes`` in both directions (grpc refuses a larger one with RESOURCE_EXHAUSTED
before we see it).
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
import torch

from modelwarden.gateway import access, kserve
from modelwarden.gateway.proto import grpc_predict_v2_pb2 as pb
from modelwarden.gateway.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from modelwarden.gateway.service import InferenceService, error_of
from modelwarden.shared import protocol

logger = logging.getLogger(__name__)

# typed contents: the InferTensorContents field each datatype travels in
_CONTENTS_FIELD = {"BOOL": "bool_contents", "UINT8": "uint_contents", "INT8": "int_contents",
                   "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents"}


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
    await context.abort(getattr(grpc.StatusCode, kserve.grpc_status(code)),
                        kserve.error_text(code, message))


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
    values = getattr(contents, field)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(values) != count:
        raise kserve.bad_input(f"input {name!r}: {len(values)} values in contents.{field}, but "
                               f"shape {list(shape)} holds {count}")
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
                             shape=list(tensor.shape))
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


class _Unreadable:
    """A request message protobuf could not parse (a DecodeError), handed to the method."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _tolerant(parse):
    # grpc's own handling of a deserializer's exception is UNKNOWN and a traceback in the log
    # for every such message; a malformed message is the caller's error: INVALID_ARGUMENT.
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as exc:
            return _Unreadable(str(exc)[:120])

    return deserialize


def _checked(method, name: str, gate: access.Gatekeeper | None):
    """The caller's token first (unless the method is open), then the message's shape."""
    guarded = gate is not None and name not in access.OPEN_METHODS

    async def handle(request, context):
        if guarded and not gate.allows(_authorization(context)):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, kserve.error_text(
                "UNAUTHENTICATED", "this gateway needs the metadata authorization: Bearer TOKEN, "
                                   "with a token from its token_file"))
        if isinstance(request, _Unreadable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, kserve.error_text(
                protocol.BAD_REQUEST, f"the message is not a valid {SERVICE} request: {request.problem}"))
        return await method(request, context)

    return handle


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


def add_service(server: grpc.aio.Server, service: InferenceService,
                gate: access.Gatekeeper | None = None) -> None:
    """The generated ``add_GRPCInferenceServiceServicer_to_server``, but a request that does not
    parse is answered INVALID_ARGUMENT by us instead of UNKNOWN by grpc, and a caller without a
    token (when ``gate`` asks for one) UNAUTHENTICATED."""
    servicer = InferenceServicer(service)
    handlers = {name: grpc.unary_unary_rpc_method_handler(
                    _checked(getattr(servicer, name), name, gate),
                    request_deserializer=_tolerant(request.FromString),
                    response_serializer=response.SerializeToString)
                for name, (request, response) in METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
