"""What a model's outputs are, learned from a forward pass: for metadata that needs no guessing.

A model whose configuration declares no ``outputs`` still has them; the worker reports them in
its READY info (``"outputs"``), learned from its last warm-up forward, and the supervisor lists
them in ``hello`` and in KServe model metadata (supervisor/fleet/pool.py keeps them per version).

Names follow the gateway's own naming of undeclared outputs (gateway/kserve.name_outputs), so the
metadata names what an infer returns: a dict's keys, else ``output__0``, ``output__1``, ...
"""

from __future__ import annotations

from typing import Any

import torch

from modelwarden.shared.codec import DTYPE_NAMES


def learned_outputs(outputs: Any, batch_dim: int | None, varying: tuple[int, ...] = ()) -> list[dict]:
    """``[{"name", "dtype", "shape"}]`` for a forward's outputs (a tensor, numpy array, a
    list/tuple or dict of them, or str/bytes lists from a handler's postprocess).

    ``batch_dim``: the dimension set to -1 (None: none), as are the ``varying`` ones (a bucketed
    length). An item that is itself nested, or of a type that does not travel, is left out: the
    Open Inference Protocol cannot name it (gateway/kserve.flatten_outputs refuses it too)."""
    if isinstance(outputs, dict):
        items = [(str(key), value) for key, value in outputs.items()]
    elif isinstance(outputs, (list, tuple)) and not _is_elements(outputs):
        items = [(f"output__{index}", value) for index, value in enumerate(outputs)]
    else:
        items = [("output__0", outputs)]
    specs = []
    for name, value in items:
        described = _describe(value)
        if described is not None:
            dtype, shape = described
            specs.append({"name": name, "dtype": dtype,
                          "shape": _vary(shape, {batch_dim, *varying} - {None})})
    return specs


def _vary(shape: list[int], dims: set) -> list[int]:
    return [-1 if index in dims else size for index, size in enumerate(shape)]


def _describe(value: Any) -> tuple[str, list[int]] | None:
    if isinstance(value, torch.Tensor):
        return DTYPE_NAMES.get(value.dtype, str(value.dtype)), list(value.shape)
    if hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape"):
        kind = getattr(value.dtype, "kind", "")
        if kind in "US":  # numpy text: one element leaf
            return ("str" if kind == "U" else "bytes"), list(value.shape)
        return str(value.dtype), list(value.shape)
    if isinstance(value, (str, bytes)):
        return ("str" if isinstance(value, str) else "bytes"), []
    if isinstance(value, (list, tuple)) and _is_elements(value):
        return _element_type(value), _element_shape(value)
    if isinstance(value, (bool, int, float)):  # sent as 0-d tensors
        return DTYPE_NAMES[torch.as_tensor(value).dtype], []
    return None


def _flat_elements(value: Any) -> list | None:
    """The str/bytes items of a (nested) list, or None when it is not one."""
    if isinstance(value, (str, bytes)):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        items = []
        for item in value:
            inner = _flat_elements(item)
            if inner is None:
                return None
            items.extend(inner)
        return items
    return None


def _is_elements(value: Any) -> bool:
    items = _flat_elements(value)
    return bool(items) and (all(isinstance(item, str) for item in items)
                            or all(isinstance(item, bytes) for item in items))


def _element_type(value: Any) -> str:
    return "str" if isinstance(_flat_elements(value)[0], str) else "bytes"


def _element_shape(value: Any) -> list[int]:
    shape = []
    while isinstance(value, (list, tuple)):
        shape.append(len(value))
        value = value[0]
    return shape
