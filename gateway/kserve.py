"""The Open Inference Protocol (KServe v2) in pure functions: no sockets, no HTTP, no gRPC.

What the REST and gRPC fronts (gateway/http.py, gateway/grpc_service.py) share:

* datatype names: the protocol's ``BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, BF16, FP32,
  FP64`` <-> modelwarden's dtype names (shared/protocol.py ``DTYPES``) and torch dtypes, and
  ``BYTES`` <-> modelwarden's str/bytes elements (``ELEMENT_TYPES``): a BYTES input is bytes
  elements, or str where the model declares the input ``dtype = "str"`` (``as_declared``:
  UTF-8 checked). The protocol's UINT16/32/64 have no torch tensor: refused with BAD_INPUT.
* tensors in: ``raw_tensor`` (raw bytes: the binary data extension, gRPC's raw_input_contents)
  and ``json_tensor`` (a JSON ``data`` list, flat or nested, row-major) -> a torch tensor, after
  checking the datatype name, the shape and that the data holds exactly shape's elements. For
  BYTES they give ``codec.Elements``: raw, the 4-byte little-endian length prefixes checked and
  passed through as they came (they are the native wire form); JSON, a list of strings.
* tensors out: ``tensor_datatype``, ``tensor_bytes`` (raw, little-endian, row-major) and
  ``tensor_json`` (a flat list).
* a REST request body: ``split_body`` (the ``Inference-Header-Content-Length`` split),
  ``parse_infer_request`` (inputs, requested outputs, id, parameters), ``infer_response``.
* errors: every failure is a ``ProtocolError(code, message)`` with one of modelwarden's error
  codes; ``HTTP_STATUS`` and ``GRPC_STATUS`` map a code to the status the caller sees, and
  ``error_text`` is what the caller reads: the code, then the message (never a traceback).

Torch is imported here because tensors go to the native client as torch tensors (numpy has no
bfloat16); this module is the gateway's alone, never the supervisor's.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from modelwarden.shared import protocol
from modelwarden.shared.codec import Elements, elements
from modelwarden.shared.descriptors import ElementList, split_elements
from modelwarden.shared.protocol import (BAD_INPUT, BAD_REQUEST, INTERNAL, MODEL_ERROR, NO_WORKER,
                                         OUT_OF_MEMORY, OVERLOADED, POISON, SHUTTING_DOWN, TIMEOUT,
                                         UNKNOWN_MODEL, WORKER_DIED, ProtocolError)

# protocol datatype <-> modelwarden dtype name (shared/protocol.py DTYPES)
DATATYPES: dict[str, str] = {
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32",
    "INT64": "int64", "FP16": "float16", "BF16": "bfloat16", "FP32": "float32", "FP64": "float64",
}
BYTES = "BYTES"  # the protocol's variable-length datatype: modelwarden's str/bytes elements
DTYPE_DATATYPES: dict[str, str] = {**{dtype: name for name, dtype in DATATYPES.items()},
                                   "str": BYTES, "bytes": BYTES}
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "BF16": torch.bfloat16,
    "FP32": torch.float32, "FP64": torch.float64,
}
DATATYPE_OF_TORCH: dict[torch.dtype, str] = {value: key for key, value in TORCH_DTYPES.items()}
# JSON values are parsed by numpy first; BF16 has no numpy type and goes through float32.
_JSON_NUMPY: dict[str, np.dtype] = {
    name: np.dtype("float32" if name == "BF16" else DATATYPES[name]) for name in DATATYPES}
_JSON_KINDS: dict[str, tuple[type, ...]] = {"BOOL": (bool,), "FP16": (int, float), "BF16": (int, float),
                                            "FP32": (int, float), "FP64": (int, float)}

HTTP_STATUS: dict[str, int] = {
    BAD_REQUEST: 400, BAD_INPUT: 400, UNKNOWN_MODEL: 404, OVERLOADED: 503, NO_WORKER: 503,
    SHUTTING_DOWN: 503, TIMEOUT: 504, MODEL_ERROR: 500, WORKER_DIED: 500, POISON: 500,
    INTERNAL: 500, OUT_OF_MEMORY: 500,
}
GRPC_STATUS: dict[str, str] = {  # names of grpc.StatusCode: this module does not import grpc
    BAD_REQUEST: "INVALID_ARGUMENT", BAD_INPUT: "INVALID_ARGUMENT", UNKNOWN_MODEL: "NOT_FOUND",
    OVERLOADED: "UNAVAILABLE", NO_WORKER: "UNAVAILABLE", SHUTTING_DOWN: "UNAVAILABLE",
    TIMEOUT: "DEADLINE_EXCEEDED", MODEL_ERROR: "INTERNAL", WORKER_DIED: "INTERNAL",
    POISON: "INTERNAL", INTERNAL: "INTERNAL", OUT_OF_MEMORY: "INTERNAL",
}
if set(HTTP_STATUS) != set(protocol.ERROR_CODES) or set(GRPC_STATUS) != set(protocol.ERROR_CODES):
    raise ImportError("gateway.kserve must map every modelwarden error code")

# A tensor over a request body's bytes is only read (the client copies or sends it); torch warns
# once that the buffer is read-only, which says nothing we act on.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

MAX_DIMS = 32
# The most elements a shape may describe, zero dimensions counted as one: torch computes
# strides from every dimension, so [0, 2**39, 2**39] (no elements) would still overflow them.
MAX_ELEMENTS = 2**40
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # the native protocol's bound on timeout_ms
HEADER_LENGTH = "inference-header-content-length"  # the binary data extension's HTTP header
EXTENSIONS = ["binary_tensor_data", "model_configuration"]


def http_status(code: str) -> int:
    return HTTP_STATUS.get(code, 500)


def grpc_status(code: str) -> str:
    return GRPC_STATUS.get(code, "INTERNAL")


def error_text(code: str, message: str) -> str:
    """What the caller reads: the modelwarden code first, as the native client's errors do."""
    return f"{code}: {message}"


def bad_input(message: str) -> ProtocolError:
    return ProtocolError(BAD_INPUT, message)


def bad_request(message: str) -> ProtocolError:
    return ProtocolError(BAD_REQUEST, message)


# -- shapes and datatypes ---------------------------------------------------------------------


def check_datatype(name: str, datatype: Any) -> str:
    if not isinstance(datatype, str):
        raise bad_input(f"input {name!r}: 'datatype' must be a string")
    if datatype not in DATATYPES and datatype != BYTES:
        hint = " (no torch tensor holds it)" if datatype in ("UINT16", "UINT32", "UINT64") else ""
        raise bad_input(f"input {name!r}: datatype {datatype[:32]!r} is not supported{hint}; "
                        f"supported: {', '.join(DATATYPES)}, {BYTES}")
    return datatype


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
            or not all(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < 2**40
                       for dim in shape)):
        raise bad_input(f"input {name!r}: 'shape' must be a list of at most {MAX_DIMS} "
                        "non-negative integers")
    if math.prod(max(dim, 1) for dim in shape) > MAX_ELEMENTS:
        raise bad_input(f"input {name!r}: shape {list(shape)[:MAX_DIMS]} describes more than "
                        f"{MAX_ELEMENTS} elements")
    return tuple(shape)


def byte_size(datatype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * protocol.DTYPES[DATATYPES[datatype]]


def metadata_shape(shape: list[int], batch_dim: int | None) -> list[int]:
    """A declared shape as the protocol reports it: -1 for dynamic dimensions and, when the
    model batches, for its batch dimension."""
    return [-1 if index == batch_dim else dim for index, dim in enumerate(shape)]


def tensor_metadata(specs: list[dict] | None, batch_dim: int | None) -> list[dict]:
    """Declared inputs or outputs ({name, dtype, shape}) as protocol tensor metadata."""
    return [{"name": spec["name"], "datatype": DTYPE_DATATYPES.get(spec["dtype"], spec["dtype"].upper()),
             "shape": metadata_shape(list(spec["shape"]), batch_dim)} for spec in specs or []]


def model_config(name: str, entry: dict) -> dict:
    """Triton's model configuration (its JSON form) for a model's hello entry: what
    perf_analyzer and model_analyzer read before they send anything.

    A model that batches along dimension 0 reports ``max_batch_size`` (its batching
    ``max_size``) and dims without that dimension, as Triton does; any other model reports 0
    and its whole declared shapes (-1 where a dimension varies)."""
    batch_dim = entry.get("batch_dim")
    batched = batch_dim == 0
    max_batch = int(entry.get("max_batch_size") or 0) if batched else 0

    def tensors(specs: list[dict] | None) -> list[dict]:
        # complex dtypes have no Triton type: TYPE_INVALID, as Triton says of a type it lacks
        return [{"name": item["name"], "dims": item["shape"][1:] if batched else item["shape"],
                 "data_type": "TYPE_STRING" if item["datatype"] == BYTES
                 else f"TYPE_{item['datatype']}" if item["datatype"] in DATATYPES
                 else "TYPE_INVALID"}
                for item in tensor_metadata(specs, batch_dim)]

    config = {"name": name, "platform": "pytorch", "backend": "modelwarden",
              "max_batch_size": max_batch,
              "input": tensors(entry.get("inputs")), "output": tensors(entry.get("outputs"))}
    if batched and max_batch > 1:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": int(entry.get("batch_delay_us") or 0)}
    return config


# -- tensors in -------------------------------------------------------------------------------


def raw_tensor(name: str, datatype: str, shape: tuple[int, ...], data) -> torch.Tensor | Elements:
    """A tensor over ``data`` (bytes-like; not copied), which must hold exactly shape's bytes;
    for BYTES, the elements ``data`` holds (``raw_elements``)."""
    if datatype == BYTES:
        return raw_elements(name, shape, data)
    expected = byte_size(datatype, shape)
    got = memoryview(data).nbytes
    if got != expected:
        raise bad_input(f"input {name!r}: {got} bytes of data, but {datatype} {list(shape)} "
                        f"needs {expected}")
    dtype = TORCH_DTYPES[datatype]
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def json_tensor(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> torch.Tensor | Elements:
    """A tensor from a JSON ``data`` list (flat or nested, row-major); for BYTES, the elements
    of a list of strings."""
    if not isinstance(data, list):
        raise bad_input(f"input {name!r}: 'data' must be a list")
    count = check_element_count(name, shape) if datatype == BYTES else math.prod(shape)
    flat = _flatten_json(name, data)
    if len(flat) != count:
        raise bad_input(f"input {name!r}: {len(flat)} values in 'data', but shape {list(shape)} "
                        f"holds {count}")
    if datatype == BYTES:
        return listed_elements(name, shape, flat)
    kinds = _JSON_KINDS.get(datatype, (int,))
    for value in flat:
        # bool is an int in Python: only BOOL takes true/false, and BOOL takes nothing else.
        if not isinstance(value, kinds) or (isinstance(value, bool) and datatype != "BOOL"):
            raise bad_input(f"input {name!r}: {json.dumps(value)[:32]} is not a {datatype} value")
    try:
        array = np.array(flat, dtype=_JSON_NUMPY[datatype]).reshape(shape)
    except (OverflowError, ValueError) as exc:
        raise bad_input(f"input {name!r}: a value does not fit {datatype} ({exc})") from None
    tensor = torch.from_numpy(array)
    return tensor.to(torch.bfloat16) if datatype == "BF16" else tensor


# -- BYTES: str/bytes elements ----------------------------------------------------------------


def check_element_count(name: str, shape: tuple[int, ...]) -> int:
    """prod(shape) of a BYTES input, refused past the native limit before any data is read."""
    count = math.prod(shape)
    if math.prod(max(dim, 1) for dim in shape) > protocol.MAX_ELEMENTS:
        raise bad_input(f"input {name!r}: shape {list(shape)} holds more than "
                        f"{protocol.MAX_ELEMENTS} BYTES elements")
    return count


def raw_elements(name: str, shape: tuple[int, ...], data) -> Elements:
    """The BYTES elements of ``data``, the binary form (each a 4-byte little-endian length,
    then its bytes, row-major): checked whole (the count shape gives, no prefix past the end, no
    bytes after the last, within MAX_ELEMENT_BYTES) and passed on as they are."""
    count = check_element_count(name, shape)
    size = memoryview(data).nbytes
    if size > protocol.MAX_ELEMENT_BYTES:
        raise bad_input(f"input {name!r}: {size} bytes of BYTES data exceed "
                        f"{protocol.MAX_ELEMENT_BYTES}")
    try:
        _, longest = split_elements(data, count, text=False)
    except ProtocolError as exc:
        raise bad_input(f"input {name!r}: {exc.message} (BYTES {list(shape)})") from None
    return Elements("bytes", shape, bytes(data), longest)


def listed_elements(name: str, shape: tuple[int, ...], flat: list) -> Elements:
    """The elements of JSON strings (flat, row-major) or gRPC's bytes_contents."""
    if flat and not all(isinstance(value, (str, bytes)) for value in flat):
        bad = next(value for value in flat if not isinstance(value, (str, bytes)))
        raise bad_input(f"input {name!r}: {json.dumps(bad)[:32]} is not a BYTES value (a string)")
    try:
        return elements("bytes", shape, [value.encode("utf-8") if isinstance(value, str)
                                         else value for value in flat])
    except UnicodeEncodeError:  # "\ud800" in JSON: a lone surrogate, no UTF-8 form
        raise bad_input(f"input {name!r}: a string is not valid Unicode (a lone surrogate)") from None
    except TypeError as exc:  # past MAX_ELEMENT_BYTES
        raise bad_input(f"input {name!r}: {exc}") from None


def as_declared(name: str, value: Any, dtype: str | None) -> Any:
    """A BYTES input as the model declares it: str elements (the same payload, UTF-8 checked)
    for ``dtype = "str"``, else bytes as they came."""
    if not isinstance(value, Elements) or dtype != "str":
        return value
    count = math.prod(value.shape)
    try:
        split_elements(value.payload, count, text=True)
    except ProtocolError as exc:
        raise bad_input(f"input {name!r} is declared str: {exc.message.split(': ', 1)[-1]}") from None
    return value._replace(dtype="str")


def _flatten_json(name: str, data: list) -> list:
    flat: list = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                if len(stack) > MAX_DIMS:
                    raise bad_input(f"input {name!r}: 'data' nests deeper than {MAX_DIMS} levels")
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


# -- tensors out ------------------------------------------------------------------------------


def as_torch(value: Any) -> torch.Tensor | Elements:
    """One output as the gateway sends it: a tensor, or Elements for str/bytes (a bare
    str/bytes for a 0-d one, an ElementList, as the native client gives them)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (str, bytes)):
        return elements("str" if isinstance(value, str) else "bytes", (), [value])
    if isinstance(value, ElementList):
        return elements(value.dtype, value.shape, _flat_elements(value, len(value.shape)))
    return torch.from_numpy(np.asarray(value))


def _flat_elements(nested: list, dims: int) -> list:
    for _ in range(dims - 1):
        nested = [item for row in nested for item in row]
    return list(nested)


def tensor_datatype(tensor: torch.Tensor | Elements) -> str:
    if isinstance(tensor, Elements):
        return BYTES
    datatype = DATATYPE_OF_TORCH.get(tensor.dtype)
    if datatype is None:
        raise ProtocolError(MODEL_ERROR, f"the model returned a {tensor.dtype} tensor, which the "
                            "Open Inference Protocol has no datatype for")
    return datatype


def tensor_bytes(tensor: torch.Tensor | Elements) -> memoryview:
    """The tensor's bytes, row-major (a view when it is contiguous on the CPU already); BYTES
    as their length-prefixed payload."""
    if isinstance(tensor, Elements):
        return memoryview(tensor.payload).cast("B")
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)  # numpy has no bfloat16: same bytes
    return memoryview(tensor.numpy()).cast("B")


def tensor_json(tensor: torch.Tensor | Elements, name: str = "") -> list:
    if isinstance(tensor, Elements):
        return _elements_json(tensor, name)
    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.reshape(-1).tolist()


def _elements_json(value: Elements, name: str) -> list:
    """BYTES as JSON strings: bytes must be UTF-8 text to be one."""
    try:
        items, _ = split_elements(value.payload, math.prod(value.shape), text=True)
    except ProtocolError:
        raise bad_input(f"output {name!r} holds bytes that are not UTF-8 text, which JSON "
                        "cannot carry: ask for it as binary data (its parameters.binary_data "
                        "= true)") from None
    return items


def shape_of(tensor: torch.Tensor | Elements) -> list[int]:
    return list(tensor.shape)


def name_outputs(outputs: list[torch.Tensor], declared: list[dict] | None,
                 keys: list[str] | None) -> list[tuple[str, torch.Tensor]]:
    """Output names: the declared ones in order; else a dict's keys; else output__0, output__1..."""
    if declared:
        if len(declared) != len(outputs):
            raise ProtocolError(MODEL_ERROR, f"the model returned {len(outputs)} output(s), its "
                                f"configuration declares {len(declared)}")
        names = [spec["name"] for spec in declared]
    elif keys is not None:
        names = keys
    else:
        names = [f"output__{index}" for index in range(len(outputs))]
    return list(zip(names, outputs))


def flatten_outputs(value: Any) -> tuple[list, list[str] | None]:
    """The model's outputs as a flat list (and a dict's keys, which then name them)."""
    if isinstance(value, dict):
        return [as_torch(item) for item in value.values()], [str(key) for key in value]
    if isinstance(value, (list, tuple)) and not isinstance(value, ElementList):
        flat: list = []
        for item in value:
            if isinstance(item, (list, tuple, dict)) and not isinstance(item, ElementList):
                raise ProtocolError(MODEL_ERROR, "the model returned nested outputs, which the "
                                    "Open Inference Protocol cannot name")
            flat.append(as_torch(item))
        return flat, None
    return [as_torch(value)], None


# -- REST requests ----------------------------------------------------------------------------


@dataclass
class InferInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    tensor: torch.Tensor


@dataclass
class InferRequest:
    inputs: list[InferInput]
    id: str | None = None
    outputs: list[str] | None = None  # requested output names; None: every output
    binary: dict[str, bool] = field(default_factory=dict)  # an output's own binary_data
    binary_default: bool = False  # binary_data_output: every output without its own
    timeout_s: float | None = None  # parameters.timeout (microseconds, as Triton) in seconds

    def wants_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)


def decimal(value: str | None) -> int | None:
    """A header's non-negative decimal integer, or None. ASCII digits only: ``str.isdigit`` is
    true of "²" and other Unicode digits that ``int`` refuses."""
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > 20 or not value.isascii() or not value.isdigit():
        return None
    return int(value)


def header_length(value: str | None, body_length: int | None, limit: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header, checked before the body is read: it must
    be a number no larger than the body (when its length is known) and the limit."""
    if value is None:
        return None
    length = decimal(value)
    if length is None:
        raise bad_request("Inference-Header-Content-Length must be a non-negative integer")
    if length > limit:
        raise bad_request(f"Inference-Header-Content-Length {length} exceeds the gateway's "
                          f"max_message_bytes ({limit})")
    if body_length is not None and length > body_length:
        raise bad_request(f"Inference-Header-Content-Length {length} is larger than the body "
                          f"({body_length} bytes)")
    return length


def split_body(body: bytes, json_length: int | None) -> tuple[bytes | memoryview, memoryview]:
    """(the JSON part, the binary part) of a REST request body."""
    view = memoryview(body)
    if json_length is None:
        return view, view[len(view):]
    if json_length > len(view):
        raise bad_request(f"Inference-Header-Content-Length {json_length} is larger than the "
                          f"body ({len(view)} bytes)")
    return view[:json_length], view[json_length:]


def load_json(data) -> Any:
    try:
        return json.loads(bytes(data))
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:120]}") from None
    except RecursionError:  # "[[[[...": the caller's error, not an INTERNAL with a traceback
        raise bad_request("the request body is not valid JSON: nested too deeply") from None


def parse_infer_request(body: Any, binary: memoryview) -> InferRequest:
    """A REST infer request (its JSON already parsed) and its binary part -> InferRequest."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise bad_request("'inputs' must be a non-empty list")
    if len(inputs) > protocol.MAX_TENSORS:
        raise bad_request(f"at most {protocol.MAX_TENSORS} inputs")
    parsed, offset = [], 0
    for index, item in enumerate(inputs):
        tensor_input, used = _parse_input(index, item, binary[offset:])
        parsed.append(tensor_input)
        offset += used
    if offset != len(binary):
        raise bad_input(f"{len(binary) - offset} bytes of binary data after the last input's")
    names = [item.name for item in parsed]
    if len(set(names)) != len(names):
        raise bad_input("two inputs have the same name")
    request = InferRequest(parsed, id=_request_id(body.get("id")))
    parameters = _parameters(body.get("parameters"), "parameters")
    request.binary_default = _flag(parameters, "binary_data_output")
    request.timeout_s = timeout_seconds(parameters.get("timeout"))
    outputs = body.get("outputs")
    if outputs is not None:
        request.outputs, request.binary = _requested_outputs(outputs)
    return request


def _parse_input(index: int, item: Any, binary: memoryview) -> tuple[InferInput, int]:
    if not isinstance(item, dict):
        raise bad_request(f"inputs[{index}] must be an object")
    name = item.get("name")
    if not isinstance(name, str) or not name or len(name) > 128:
        raise bad_request(f"inputs[{index}]: 'name' must be a string of 1 to 128 characters")
    datatype = check_datatype(name, item.get("datatype"))
    shape = check_shape(name, item.get("shape"))
    parameters = _parameters(item.get("parameters"), f"input {name!r} parameters")
    size = parameters.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad_input(f"input {name!r}: binary_data_size must be a non-negative integer")
        if "data" in item:
            raise bad_input(f"input {name!r}: both 'data' and binary_data_size")
        if size > len(binary):
            raise bad_input(f"input {name!r}: binary_data_size {size}, but only {len(binary)} "
                            "bytes of binary data are left")
        return InferInput(name, datatype, shape, raw_tensor(name, datatype, shape, binary[:size])), size
    if "data" not in item:
        raise bad_input(f"input {name!r}: no 'data' and no binary_data_size")
    return InferInput(name, datatype, shape, json_tensor(name, datatype, shape, item["data"])), 0


def _requested_outputs(outputs: Any) -> tuple[list[str], dict[str, bool]]:
    if not isinstance(outputs, list) or len(outputs) > protocol.MAX_TENSORS:
        raise bad_request(f"'outputs' must be a list of at most {protocol.MAX_TENSORS} objects")
    names, binary = [], {}
    for index, item in enumerate(outputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise bad_request(f"outputs[{index}] must be an object with a 'name'")
        parameters = _parameters(item.get("parameters"), f"output {item['name'][:64]!r} parameters")
        if "binary_data" in parameters:
            binary[item["name"]] = _flag(parameters, "binary_data")
        names.append(item["name"])
    return names, binary


def _parameters(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be an object")
    return value


def _flag(parameters: dict, key: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise bad_request(f"parameter {key!r} must be true or false")
    return value


def _request_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > protocol.MAX_ID_BYTES:
        raise bad_request(f"'id' must be a string of at most {protocol.MAX_ID_BYTES} characters")
    return value


def timeout_seconds(value: Any) -> float | None:
    """``parameters.timeout``: microseconds, as Triton's clients send it (their ``timeout=``)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise bad_request("parameter 'timeout' must be a positive integer (microseconds)")
    # bounded as an integer first: a JSON integer of 400 digits is no float
    return max(min(value, int(MAX_TIMEOUT_S * 1e6)) / 1e6, 0.001)


def select_outputs(named: list[tuple[str, torch.Tensor]],
                   wanted: list[str] | None) -> list[tuple[str, torch.Tensor]]:
    if wanted is None:
        return named
    by_name = dict(named)
    missing = [name for name in wanted if name not in by_name]
    if missing:
        raise bad_input(f"unknown output(s) {missing[:4]}; the model's outputs: {list(by_name)}")
    return [(name, by_name[name]) for name in wanted]


def infer_response(model: str, version: str | None, request: InferRequest,
                   outputs: list[tuple[str, torch.Tensor]]) -> tuple[bytes, int | None]:
    """(body, JSON length or None): a JSON body, or the JSON header and the binary outputs
    after it when any output goes as binary data (the length then goes into
    Inference-Header-Content-Length)."""
    entries, chunks = [], []
    for name, tensor in outputs:
        entry = {"name": name, "datatype": tensor_datatype(tensor), "shape": shape_of(tensor)}
        if request.wants_binary(name):
            data = tensor_bytes(tensor)
            entry["parameters"] = {"binary_data_size": data.nbytes}
            chunks.append(data)
        else:
            entry["data"] = tensor_json(tensor, name)
        entries.append(entry)
    reply: dict[str, Any] = {"model_name": model, "model_version": version or ""}
    if request.id is not None:
        reply["id"] = request.id
    reply["outputs"] = entries
    header = json.dumps(reply, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)
