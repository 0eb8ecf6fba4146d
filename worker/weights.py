"""A model's weights from a file, mapped so that every worker shares one copy in the page cache.

Files (by suffix):
  ``.safetensors``      read here (the format is an 8-byte little-endian header length, a JSON
                        header of name -> dtype, shape, [begin, end) and the raw bytes): no library
  ``.pt``, ``.pth``     a state dict saved by ``torch.save``, read by
                        ``torch.load(weights_only=True, mmap=...)``

``mode``:
  ``"load"``  every tensor is read into this process's own memory (N workers, N copies)
  ``"mmap"``  tensors are views of a private, copy-on-write mapping of the file (``MAP_PRIVATE``):
              pages come from the page cache, so N workers hold one copy of the weights between
              them. Each worker still owns its module, buffers, threads and activations.

The contract for a model that writes to a mapped parameter: the write lands in a private copy of
the page it touched, in that worker only. The file is never written, the other workers' weights
and outputs are unchanged, and the writer now computes something else: its sentinel probe's
golden comparison catches it and the supervisor replaces it (its replacement maps the file
afresh). Nothing segfaults: the mapping is writable, but only privately.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

MODES = ("load", "mmap")
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class WeightsError(ValueError):
    """The weights file cannot be read, or does not fit the model."""


def read_state_dict(path: Path, mode: str) -> dict[str, torch.Tensor]:
    """name -> tensor from ``path``: views of a private mapping (``mmap``) or private copies."""
    if mode not in MODES:
        raise WeightsError(f"weights mode {mode!r}: use one of {', '.join(MODES)}")
    if path.suffix == ".safetensors":
        return _read_safetensors(path, mode == "mmap")
    if path.suffix in (".pt", ".pth"):
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mode == "mmap")
        if not isinstance(loaded, dict):
            raise WeightsError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
        return loaded
    raise WeightsError(f"{path}: unknown weights format; use .safetensors, .pt or .pth")


def assign_weights(module: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Make ``state_dict``'s tensors the module's own (``assign=True``: no copy into fresh
    storage, so mapped pages stay shared). Every name must match, and nothing may be left on the
    meta device (a factory that builds an empty module relies on the file for all of it)."""
    module.load_state_dict(state_dict, strict=True, assign=True)  # strict: a mismatch raises
    empty = [name for name, tensor in _tensors(module) if tensor.is_meta]
    if empty:
        raise WeightsError(f"no weights for {', '.join(empty[:5])}"
                           f"{' ...' if len(empty) > 5 else ''} (still on the meta device)")


def save_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state_dict`` as a .safetensors file (for tests, benches and export scripts)."""
    header: dict = {}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in state_dict.items():
        data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 64)  # tensors start 64-byte aligned: views need no copy
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for chunk in chunks:
            file.write(chunk)


def _tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _read_safetensors(path: Path, mapped: bool) -> dict[str, torch.Tensor]:
    with open(path, "rb") as file:
        # ACCESS_COPY is MAP_PRIVATE with PROT_READ|PROT_WRITE: shared pages until written.
        whole = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    header, start = _safetensors_header(path, whole)
    raw = torch.frombuffer(whole, dtype=torch.uint8)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensor = _safetensors_tensor(path, name, entry, raw, start)
        tensors[name] = tensor if mapped else tensor.clone()
    return tensors


def _safetensors_header(path: Path, whole: mmap.mmap) -> tuple[dict, int]:
    if len(whole) < 8:
        raise WeightsError(f"{path}: too short for a safetensors file")
    (length,) = struct.unpack_from("<Q", whole, 0)
    if length > min(_MAX_HEADER_BYTES, len(whole) - 8):
        raise WeightsError(f"{path}: header length {length} does not fit the file")
    try:
        header = json.loads(bytes(whole[8:8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a map")
    return header, 8 + length


def _safetensors_tensor(path: Path, name: str, entry, raw: torch.Tensor, start: int) -> torch.Tensor:
    try:
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = [int(dim) for dim in entry["shape"]]
        begin, end = (int(offset) for offset in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightsError(f"{path}: tensor {name!r}: bad header entry ({exc})") from None
    count = 1
    for dim in shape:
        count *= dim
    if begin < 0 or end != begin + count * dtype.itemsize or start + end > raw.numel():
        raise WeightsError(f"{path}: tensor {name!r}: offsets [{begin}, {end}) do not fit "
                           f"{entry['dtype']} {shape} in the file")
    chunk = raw[start + begin:start + end]
    if (start + begin) % dtype.itemsize:  # unaligned: a view is impossible, so a private copy
        chunk = chunk.clone()
    return chunk.view(dtype).reshape(shape)
