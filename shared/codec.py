"""Tensor codec: torch/numpy values <-> protocol descriptors plus raw bytes, without copies.

One module for both ends, so an inline frame and a shared-memory region are two forms of the same
descriptor (see shared.protocol for the wire form). Flattening turns a nested value (a tensor, a
list/tuple of them, a dict of named ones) into a TREE and a flat list of leaves; unflattening
reverses it.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from modelwarden.shared.protocol import DTYPES

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
if set(TORCH_DTYPES) != set(DTYPES):  # the protocol table and this one must agree
    raise ImportError("modelwarden.shared.codec and modelwarden.shared.protocol disagree on dtypes")

# Received frames are read-only memoryviews over buffers ZeroMQ owns; a tensor over one is safe
# to read, and torch warns about it once per process. The warning says nothing we act on.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel; supported: {', '.join(DTYPES)}") from None


def as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value) if value.dtype != np.dtype("O") else _unsupported(value)
    return _unsupported(value)


def _unsupported(value: Any) -> torch.Tensor:
    raise TypeError(f"cannot send a {type(value).__name__}: values are tensors, numpy arrays, "
                    "or lists/tuples/dicts of them")


def flatten(value: Any, leaves: list, depth: int = 0) -> Any:
    """Append every tensor leaf of ``value`` to ``leaves``; return the TREE describing it."""
    if depth > 16:
        raise TypeError("value nests deeper than 16 levels")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        leaves.append(value)
        return len(leaves) - 1
    if isinstance(value, list):
        return [flatten(item, leaves, depth + 1) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [flatten(item, leaves, depth + 1) for item in value]}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"dict keys must be str, got {type(key).__name__}")
        return {"dict": {key: flatten(item, leaves, depth + 1) for key, item in value.items()}}
    return _unsupported(value)


def unflatten(tree: Any, leaves: list) -> Any:
    if isinstance(tree, int):
        return leaves[tree]
    if isinstance(tree, list):
        return [unflatten(item, leaves) for item in tree]
    if "tuple" in tree:
        return tuple(unflatten(item, leaves) for item in tree["tuple"])
    return {key: unflatten(item, leaves) for key, item in tree["dict"].items()}


def raw_bytes(tensor: torch.Tensor):
    """A zero-copy buffer over a contiguous CPU tensor's bytes (0-d, empty, bool, bfloat16 too).
    A numpy view is the cheapest buffer torch offers; bfloat16, which numpy lacks, is viewed as
    int16 (same bytes)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def from_bytes(buffer: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buffer`` (a frame's memoryview, or a numpy uint8 array over shared
    memory), without a copy. The tensor keeps the buffer alive (torch holds a reference to a
    buffer's owner; numpy holds its base)."""
    torch_dtype = TORCH_DTYPES[dtype]
    if isinstance(buffer, np.ndarray):
        flat = torch.from_numpy(buffer)
        if torch_dtype != torch.uint8:
            flat = flat.view(torch_dtype)
    elif len(buffer) == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=torch_dtype)
    else:
        flat = torch.frombuffer(buffer, dtype=torch_dtype)
    return flat.reshape(shape)


def to_numpy(tensor: torch.Tensor) -> Any:
    """numpy view of a CPU tensor; bfloat16 has no numpy dtype and stays a torch tensor."""
    return tensor if tensor.dtype == torch.bfloat16 else tensor.numpy()


def check_finite(tensors: list[torch.Tensor]) -> str | None:
    """A message naming the first tensor holding NaN or Inf, else None."""
    for index, tensor in enumerate(tensors):
        if (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel():
            if not bool(torch.isfinite(tensor).all()):
                return f"tensor {index} holds NaN or Inf"
    return None


def check_bool_bytes(tensors: list[torch.Tensor]) -> str | None:
    """A message naming the first bool tensor holding a byte other than 0 or 1, else None.
    Such bytes make torch's bool kernels disagree with each other (``x == True`` vs ``x.any()``),
    so a model would see a value no real bool has."""
    for index, tensor in enumerate(tensors):
        if tensor.dtype == torch.bool and tensor.numel() and int(tensor.view(torch.uint8).max()) > 1:
            return f"tensor {index} is bool but holds a byte other than 0x00 or 0x01"
    return None
