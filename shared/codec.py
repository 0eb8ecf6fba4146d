"""Tensor codec: torch/numpy values <-> protocol descriptors plus raw bytes, without copies.

One module for both ends, so an inline frame and a shared-memory region are two forms of the same
descriptor (see shared.protocol for the wire form). Flattening turns a nested value (a tensor, a
list/tuple of them, a dict of named ones) into a TREE and a flat list of leaves; unflattening
reverses it.

``encode(value, place)`` turns a value -- a request's inputs or a model's outputs -- into
(tree, descs, frames). ``place(tensor, dtype, nbytes)`` is the sender's policy for one leaf: it
returns the shared-memory region (token, offset, nbytes) now holding the leaf, or None to send it
inline. The client's policy stages large inputs in its arena; the worker's is
``reply_placement``: an output that is a view of an input points into that input's buffer, one
that fits is written into the request's ``out`` region, the rest go inline. The descriptors
themselves, and the reply parser, live in ``shared/descriptors.py`` (no torch: the supervisor
reads replies too).
"""

from __future__ import annotations

import ctypes
import struct
import warnings
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from modelwarden.shared.descriptors import (ElementList, decode_elements, element_desc,
                                            inline_desc, shm_desc)
from modelwarden.shared.protocol import (DTYPES, ELEMENT_PREFIX, MAX_ELEMENT_BYTES, MAX_ELEMENTS,
                                         TensorDesc)
from modelwarden.shared.sockets import COPY_BELOW

try:
    import cython  # compiled: Cython's own; uncompiled: its shadow module, when installed
except ImportError:
    cython = None  # uncompiled without Cython: only the compiled branch of _copied uses it

# Compiled, this module is an extension (its __file__ a .so): codec.pxd gives _copied its C call.
COMPILED = not __file__.endswith(".py")
# An inline frame this small is copied into bytes through the tensor's data pointer: the socket
# copies a part below its COPY_BELOW anyway, and a numpy view costs several times the copy. A
# larger frame is a numpy view, sent without a copy. One threshold for both: the socket's.
COPIED_BELOW = COPY_BELOW

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
DTYPE_NAMES: dict[torch.dtype, str] = {value: key for key, value in TORCH_DTYPES.items()}
# numpy has no bfloat16: its bytes are viewed as int16 (same size) and retyped by torch.
NUMPY_VIEWS: dict[str, np.dtype] = {name: np.dtype("int16" if name == "bfloat16" else name)
                                    for name in TORCH_DTYPES}
if set(TORCH_DTYPES) != set(DTYPES):  # the protocol table and this one must agree
    raise ImportError("modelwarden.shared.codec and modelwarden.shared.protocol disagree on dtypes")

# Received frames are read-only memoryviews over buffers ZeroMQ owns; a tensor over one is safe
# to read, and torch warns about it once per process. The warning says nothing we act on.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# Names read per tensor, bound once: compiled, a module global is a cached dict lookup, where
# ``torch.Tensor`` is a module attribute looked up at every call.
_Tensor = torch.Tensor
_ndarray = np.ndarray
_from_numpy = torch.from_numpy
_COMPLEX = ("complex64", "complex128")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel; supported: {', '.join(DTYPES)}") from None


def as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, _Tensor):
        return value
    if isinstance(value, _ndarray):
        return _from_numpy(value) if value.dtype != np.dtype("O") else _unsupported(value)
    return _unsupported(value)


def _unsupported(value: Any) -> torch.Tensor:
    raise TypeError(f"cannot send a {type(value).__name__}: values are tensors, numpy arrays, "
                    "or lists/tuples/dicts of them")


# -- str/bytes elements -------------------------------------------------------------------------


class Elements(NamedTuple):
    """One str/bytes leaf, already in its wire form: ``payload`` is every element's uint32 LE
    byte length then its bytes, row-major (docs/PROTOCOL.md 5.8)."""

    dtype: str  # "str" or "bytes"
    shape: tuple[int, ...]
    payload: Any  # bytes-like
    longest: int
    numpy: bool = False  # made from a numpy array: the reply's tensors then come as numpy too


_PREFIX = struct.Struct("<I")


def elements(dtype: str, shape: tuple[int, ...], flat: list, numpy: bool = False) -> Elements:
    """The wire form of ``flat`` (str or bytes, row-major), checked against the protocol's
    limits: TypeError when it cannot travel (too many elements or bytes, a str that is not
    encodable as UTF-8)."""
    if len(flat) > MAX_ELEMENTS:
        raise TypeError(f"{len(flat)} str/bytes elements in one value; at most {MAX_ELEMENTS}")
    if dtype == "str":
        try:
            flat = [item.encode("utf-8") for item in flat]
        except UnicodeEncodeError as exc:
            raise TypeError(f"a str element cannot be encoded as UTF-8 ({exc.reason})") from None
    lengths = [len(item) for item in flat]
    nbytes = ELEMENT_PREFIX * len(flat) + sum(lengths)
    if nbytes > MAX_ELEMENT_BYTES:
        raise TypeError(f"{nbytes} bytes of str/bytes elements in one value; at most "
                        f"{MAX_ELEMENT_BYTES}")
    parts = []
    for item, length in zip(flat, lengths):
        parts += (_PREFIX.pack(length), item)
    return Elements(dtype, tuple(shape), b"".join(parts), max(lengths, default=0), numpy)


def element_leaf(value: Any) -> Elements | None:
    """``value`` as one str/bytes leaf, or None if it is not one: a str, a bytes, a non-empty
    list/tuple of only str (or only bytes; equal-length lists nested in lists for more
    dimensions), a numpy array of kind 'U' or 'S', or an object array of only str or bytes."""
    if isinstance(value, Elements):
        return value
    if isinstance(value, (str, bytes)):
        return elements("str" if isinstance(value, str) else "bytes", (), [value])
    if isinstance(value, np.ndarray):
        return _array_leaf(value)
    if isinstance(value, (list, tuple)):
        found = _nested_elements(value, 0)
        if found is not None:
            kind, shape, flat = found
            return elements("str" if kind is str else "bytes", shape, flat)
    return None


def _array_leaf(array: np.ndarray) -> Elements | None:
    # numpy's 'U' and 'S' drop trailing NULs (its own rule): what tolist() gives is what goes.
    if array.dtype.kind not in "USO":
        return None
    flat = array.reshape(-1).tolist()
    if array.dtype.kind == "O":
        kinds = {type(item) for item in flat}
        if kinds not in ({str}, {bytes}):
            return None  # as_tensor refuses it with the usual message
        return elements("str" if kinds == {str} else "bytes", array.shape, flat, True)
    return elements("str" if array.dtype.kind == "U" else "bytes", array.shape, flat, True)


def _nested_elements(value: list | tuple, depth: int) -> tuple[type, tuple, list] | None:
    """(str or bytes, shape, row-major elements) of a rectangular nest, else None."""
    if not value or depth > 32:
        return None
    first = value[0]
    if isinstance(first, (str, bytes)):
        kind = str if isinstance(first, str) else bytes
        return (kind, (len(value),), list(value)) if all(
            isinstance(item, kind) for item in value) else None
    if not isinstance(first, list):
        return None
    rows = [_nested_elements(item, depth + 1) if isinstance(item, list) else None
            for item in value]
    if any(row is None for row in rows) or len({row[:2] for row in rows}) != 1:
        return None
    kind, shape = rows[0][0], rows[0][1]
    return kind, (len(value), *shape), [item for row in rows for item in row[2]]


def flatten(value: Any, leaves: list, depth: int = 0) -> Any:
    """Append every leaf of ``value`` to ``leaves``; return the TREE describing it. A leaf is a
    tensor, a numpy array, or one str/bytes value (``element_leaf``), which becomes Elements."""
    if depth > 16:
        raise TypeError("value nests deeper than 16 levels")
    if isinstance(value, _Tensor) or (isinstance(value, _ndarray) and value.dtype.kind not in "USO"):
        leaves.append(value)
        return len(leaves) - 1
    found = element_leaf(value)
    if found is not None:
        leaves.append(found)
        return len(leaves) - 1
    if isinstance(value, np.ndarray):  # an object array that holds something else
        return _unsupported(value)
    # Loops, not comprehensions: compiled, this is a cpdef function (shared/codec.pxd), which
    # may hold no closure.
    if isinstance(value, (list, tuple)):
        items = []
        for item in value:
            items.append(flatten(item, leaves, depth + 1))
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"dict keys must be str, got {type(key).__name__}")
        named = {}
        for key, item in value.items():
            named[key] = flatten(item, leaves, depth + 1)
        return {"dict": named}
    return _unsupported(value)


def unflatten(tree: Any, leaves: list) -> Any:
    if isinstance(tree, int):
        return leaves[tree]
    if isinstance(tree, list) or "tuple" in tree:
        items = []
        for item in (tree if isinstance(tree, list) else tree["tuple"]):
            items.append(unflatten(item, leaves))
        return items if isinstance(tree, list) else tuple(items)
    named = {}
    for key, item in tree["dict"].items():
        named[key] = unflatten(item, leaves)
    return named


def raw_bytes(tensor: torch.Tensor):
    """A zero-copy buffer over a contiguous CPU tensor's bytes (0-d, empty, bool, bfloat16 too).
    A numpy view is the cheapest buffer torch offers; bfloat16, which numpy lacks, is viewed as
    int16 (same bytes)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def from_bytes(buffer: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buffer`` (a frame, or anything else with the buffer protocol, or a numpy
    uint8 array over shared memory), without a copy. The tensor keeps ``buffer`` itself alive:
    a finalizer on it (the client's region release) runs only once the tensor is gone."""
    if isinstance(buffer, _ndarray):
        # torch holds this very array; a numpy view of it would hold only its memory's owner.
        flat = _from_numpy(buffer)
        if dtype != "uint8":
            flat = flat.view(TORCH_DTYPES[dtype])
        return flat.reshape(shape)
    # A frame: one numpy array made in its shape over the frame's memory (a third cheaper than
    # np.frombuffer + reshape, which cost a fraction of torch.frombuffer + reshape). The array
    # holds the buffer's owner (the frame itself, or a memoryview's), which holds the memory.
    tensor = _from_numpy(_ndarray(shape, NUMPY_VIEWS[dtype], buffer))
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def to_numpy(tensor: torch.Tensor) -> Any:
    """numpy view of a CPU tensor; bfloat16 has no numpy dtype and stays a torch tensor."""
    return tensor if tensor.dtype == torch.bfloat16 else tensor.numpy()


def check_finite(tensors: list[torch.Tensor]) -> str | None:
    """A message naming the first tensor holding NaN or Inf, else None."""
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):  # str/bytes elements
            continue
        if (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel():
            if not bool(torch.isfinite(tensor).all()):
                return f"tensor {index} holds NaN or Inf"
    return None


def check_bool_bytes(tensors: list[torch.Tensor]) -> str | None:
    """A message naming the first bool tensor holding a byte other than 0 or 1, else None.
    Such bytes make torch's bool kernels disagree with each other (``x == True`` vs ``x.any()``),
    so a model would see a value no real bool has."""
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool and tensor.numel() and int(tensor.view(torch.uint8).max()) > 1:
            return f"tensor {index} is bool but holds a byte other than 0x00 or 0x01"
    return None


# -- encoding a value ---------------------------------------------------------------------------

Region = tuple[str, int, int]  # (token, offset, nbytes) of shared memory holding a tensor
Placement = Callable[[torch.Tensor, str, int], "Region | None"]


class Encoded(NamedTuple):
    tree: Any
    descs: list[dict]
    frames: list  # buffers, one per inline descriptor, in order
    leaves: list  # the values as given (tensors or numpy arrays), in descriptor order


def encode(value: Any, place: Placement) -> Encoded:
    """``value`` as a TREE, wire descriptors and inline frames; ``place`` decides, per leaf,
    whether it travels in shared memory (see the module docstring). Raises TypeError for a value
    or dtype that cannot travel."""
    leaves: list = []
    tree = flatten(value, leaves)
    descs, frames = encode_leaves(leaves, place)
    # Encoded(...) without the Python frame of a NamedTuple's __new__: the same tuple, in C.
    return tuple.__new__(Encoded, (tree, descs, frames, leaves))


def encode_leaves(leaves: list, place: Placement) -> tuple[list[dict], list]:
    """Descriptors and inline frames for already flattened leaves (a batch member's share of
    the outputs, say), in order."""
    descs, frames = [], []
    for leaf in leaves:
        if isinstance(leaf, Elements):
            descs.append(_encode_elements(leaf, place, frames))
            continue
        tensor = as_tensor(leaf)
        dtype = dtype_name(tensor.dtype)
        nbytes = tensor.nbytes
        region = place(tensor, dtype, nbytes)
        if region is not None:
            descs.append(shm_desc(dtype, tensor.shape, region))
            continue
        if not tensor.is_cpu or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
        descs.append(inline_desc(dtype, tensor.shape, len(frames)))
        frames.append(inline_frame(tensor, nbytes, dtype))
    return descs, frames


def inline_frame(tensor: torch.Tensor, nbytes: int, dtype: str | None = None) -> Any:
    """The frame of a contiguous CPU tensor sent inline: below COPIED_BELOW bytes its bytes,
    copied through its data pointer; else a numpy view, which keeps the tensor alive until
    libzmq has sent it. A tensor numpy refuses (one that requires grad, a lazily conjugated or
    negated view) goes to numpy either way, which says why. ``dtype``, its name when the caller
    knows it: only a complex tensor can be a conjugated view, and each question asked of a
    tensor is a method call."""
    if (nbytes < COPIED_BELOW and not tensor.requires_grad
            and (dtype is not None and dtype not in _COMPLEX or not tensor.is_conj())
            and not tensor.is_neg()):
        return _copied(tensor.data_ptr(), nbytes)
    return raw_bytes(tensor)


def _copied(address: int, nbytes: int) -> bytes:
    """``nbytes`` bytes from ``address`` (memory the caller keeps alive), as one bytes object."""
    if COMPILED:
        return PyBytes_FromStringAndSize(cython.cast(cython.p_char, cython.cast(cython.size_t, address)),
                                         nbytes)
    return ctypes.string_at(address, nbytes)


def _encode_elements(leaf: Elements, place: Placement, frames: list) -> dict:
    """A str/bytes leaf's descriptor; its payload goes where ``place`` puts a uint8 tensor of
    the same bytes (shared memory when large), else inline."""
    nbytes = len(leaf.payload)
    if nbytes:
        raw = torch.from_numpy(np.frombuffer(leaf.payload, dtype=np.uint8))
        region = place(raw, "uint8", nbytes)
        if region is not None:
            return element_desc(leaf.dtype, leaf.shape, nbytes, leaf.longest, region=region)
    frames.append(leaf.payload)
    return element_desc(leaf.dtype, leaf.shape, nbytes, leaf.longest, frame=len(frames) - 1)


def inline_only(tensor: torch.Tensor, dtype: str, nbytes: int) -> None:
    """The placement of a sender without shared memory."""
    return None


def copy_into(view: np.ndarray, tensor: torch.Tensor, dtype: str, parallel: bool = True) -> None:
    """Write ``tensor`` into ``view`` (a uint8 array over shared memory of exactly its size).

    ``parallel=False`` copies on the calling thread alone (numpy), for a client: torch's copy_
    splits a large copy across all its intra-op threads and waits for the slowest, and on a
    machine whose cores the daemon's processes keep busy that wait dominates -- a 4 MiB copy
    measured 24-32 ms p50 that way against 0.1 ms with numpy (2 cores, daemon under load)."""
    if not parallel and tensor.is_cpu and not (tensor.requires_grad or tensor.is_conj()
                                                or tensor.is_neg()):
        source = raw_bytes(tensor)  # a numpy view, strides kept (bfloat16 as int16)
        np.copyto(view.view(source.dtype).reshape(source.shape), source)
        return
    from_bytes(view, dtype, tuple(tensor.shape)).copy_(tensor)


def alias_region(tensor: torch.Tensor, nbytes: int, segments: list) -> tuple[Any, int] | None:
    """The segment (anything with ``address`` and ``size``) holding ``tensor``'s bytes, and its
    offset there, if the tensor lies inside one: an output that *is* an input comes back as a
    pointer into it, as the same tensor would in-process, with no copy at all."""
    if not segments or nbytes == 0 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    address = tensor.data_ptr()
    for segment in segments:
        start = segment.address
        if start <= address and address + nbytes <= start + segment.size:
            return segment, address - start
    return None


class OutRegion:
    """A request's ``out`` region, filled front to back: each output that fits is copied in at
    the next ALIGN-aligned offset."""

    def __init__(self, token: str, offset: int, view: np.ndarray, align: int) -> None:
        self.token = token
        self.offset = offset
        self.view = view  # uint8, the whole region
        self.align = align
        self.cursor = 0

    def write(self, tensor: torch.Tensor, dtype: str, nbytes: int) -> Region | None:
        """The region now holding ``tensor``, or None if it does not fit in what is left."""
        start = self.cursor
        if start + nbytes > len(self.view):
            return None
        copy_into(self.view[start:start + nbytes], tensor, dtype)
        self.cursor += -(-nbytes // self.align) * self.align
        return self.token, self.offset + start, nbytes


def reply_placement(sources: list, out: OutRegion | None, threshold: int) -> Placement:
    """The worker's rule for one output: a view of an input buffer (a segment in ``sources``)
    points into it; else one of ``threshold`` bytes or more goes into ``out`` if it fits; else
    inline."""
    def place(tensor: torch.Tensor, dtype: str, nbytes: int) -> Region | None:
        alias = alias_region(tensor, nbytes, sources)
        if alias is not None:
            return alias[0].token, alias[1], nbytes
        if out is not None and nbytes >= threshold:
            return out.write(tensor, dtype, nbytes)
        return None
    return place


# -- decoding a reply ---------------------------------------------------------------------------


def frame_tensor(desc: TensorDesc, frames: list) -> Any:
    """The tensor of an inline descriptor, over its (checked) frame: no copy. A str/bytes
    descriptor gives its elements instead (a list nested per shape, the bare element for 0-d);
    a payload that does not hold what it declares raises ProtocolError(BAD_REQUEST)."""
    frame = frames[desc.frame]
    if desc.longest is not None:
        return decode_elements(getattr(frame, "buffer", frame), desc)
    return from_bytes(frame, desc.dtype, desc.shape)  # the frame's own buffer: no memoryview
