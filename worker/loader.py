"""Load this worker's own copy of the model, and build its example inputs.

Sources:
  ``torchscript:PATH``      torch.jit.load
  ``export:PATH``           torch.export.load of a .pt2 file; its .module() is called
  ``python:module:callable`` a factory called with the model's ``kwargs``, returning an
                            nn.Module or any callable
  ``handler:module:Class``  a modelwarden.handler.Handler subclass: built with no arguments,
                            then ``load(device, threads, **kwargs)``; its hooks do the rest
Relative paths are relative to the configuration file's directory.

With ``weights_file`` set, the module the source gave takes its parameters and buffers from that
file (worker/weights.py), mapped copy-on-write when ``weights = "mmap"``, before it is moved to
its device.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from modelwarden.handler import Handler
from modelwarden.shared.codec import TORCH_DTYPES
from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.protocol import ELEMENT_TYPES
from modelwarden.shared.weightsfile import resolve_weights_file
from modelwarden.worker.weights import assign_weights, read_state_dict


class LoadError(RuntimeError):
    """The model could not be loaded; the message is shown in ``modelwarden status``."""


def load_model(spec: WorkerSpec, device: torch.device) -> Callable | Handler:
    scheme, _, rest = spec.model.source.partition(":")
    try:
        model = _LOADERS[scheme](rest, spec, device)
        if spec.model.weights_file is not None:
            _load_weights(model, spec)
        if isinstance(model, torch.nn.Module):
            model = _to_inference(model, device)
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{spec.model.source}: {type(exc).__name__}: {exc}") from exc
    if not callable(model) and not isinstance(model, Handler):
        raise LoadError(f"{spec.model.source} gave a {type(model).__name__}, not a callable")
    return model


def _load_weights(model: Any, spec: WorkerSpec) -> None:
    if not isinstance(model, torch.nn.Module):
        raise LoadError(f"{spec.model.source} gave a {type(model).__name__}, not an nn.Module: "
                        "weights_file cannot be loaded into it")
    path = resolve_weights_file(spec.model.weights_file, Path(spec.base_dir), spec.python_path)
    assign_weights(model, read_state_dict(path, spec.model.weights))


def _to_inference(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    try:
        model.eval()
    except NotImplementedError:  # torch.export modules refuse eval(): they are traced as they run
        pass
    return model


def _resolve(spec: WorkerSpec, path: str) -> Path:
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else Path(spec.base_dir) / candidate


def _torchscript(rest: str, spec: WorkerSpec, device: torch.device):
    return torch.jit.load(str(_resolve(spec, rest)), map_location=device)


def _export(rest: str, spec: WorkerSpec, device: torch.device):
    return torch.export.load(str(_resolve(spec, rest))).module()


def _python(rest: str, spec: WorkerSpec, device: torch.device):
    return _named(rest, spec)(**spec.model.kwargs)


def _handler(rest: str, spec: WorkerSpec, device: torch.device) -> Handler:
    cls = _named(rest, spec)
    if not (isinstance(cls, type) and issubclass(cls, Handler)):
        raise LoadError(f"{spec.model.source} is not a subclass of modelwarden.handler.Handler")
    handler = cls()
    handler.load(device, torch.get_num_threads(), **spec.model.kwargs)
    return handler


def _named(rest: str, spec: WorkerSpec) -> Any:
    """``module:attribute.path``, imported from the configured python_path first."""
    module_name, _, attribute = rest.partition(":")
    for entry in reversed(spec.python_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


_LOADERS = {"torchscript": _torchscript, "export": _export, "python": _python,
            "handler": _handler}


def example_inputs(spec: WorkerSpec, seed: int, device: torch.device) -> tuple:
    """Seeded random inputs of the declared spec (-1 dims as 1), as positional arguments."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for declared in spec.model.inputs or []:
        shape = [1 if dim == -1 else dim for dim in declared.shape]
        value = _random(declared.dtype, shape, generator)
        tensors.append(value.to(device) if isinstance(value, torch.Tensor) else value)
    return tuple(tensors)


def _random(dtype_name: str, shape: list[int], generator: torch.Generator) -> Any:
    if dtype_name in ELEMENT_TYPES:  # str/bytes: short seeded words, as a request brings them
        return _random_words(dtype_name, shape, generator)
    dtype = TORCH_DTYPES[dtype_name]
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    return torch.randint(0, 16, shape, generator=generator).to(dtype)


def _random_words(dtype_name: str, shape: list[int], generator: torch.Generator) -> Any:
    count = math.prod(shape)
    codes = torch.randint(ord("a"), ord("z") + 1, (count, 8), generator=generator).tolist()
    words = ["".join(map(chr, word)) for word in codes]
    flat = words if dtype_name == "str" else [word.encode() for word in words]
    return np.array(flat, dtype=object).reshape(shape).tolist() if shape else flat[0]


def probe_value(spec: WorkerSpec, device: torch.device) -> Any:
    """The sentinel's request: a file or seeded random inputs of the spec. A .json file holds a
    request's inputs as a client would send them (a handler's texts, say); .npy, .npz and .pt
    hold tensors, passed positionally."""
    path = spec.model.probe.input
    if path is None:
        return example_inputs(spec, spec.model.probe.seed, device)
    resolved = _resolve(spec, str(path))
    if resolved.suffix == ".json":
        return json.loads(resolved.read_text())
    return tuple(tensor.to(device) for tensor in load_tensor_file(resolved))


def example_value(spec: WorkerSpec, device: torch.device) -> Any:
    """The warm-up's request: seeded inputs of the declared spec, else the probe's input."""
    if spec.model.inputs and not spec.model.source.startswith("handler:"):
        return example_inputs(spec, 0, device)
    return probe_value(spec, device)


def load_tensor_file(path: Path) -> list[torch.Tensor]:
    """Tensors from .npy (one), .npz (several, in file order) or .pt (a tensor or a list)."""
    if path.suffix == ".npy":
        return [torch.from_numpy(np.load(path, allow_pickle=False))]
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return [torch.from_numpy(archive[key]) for key in archive.files]
    loaded = torch.load(path, weights_only=True)
    return list(loaded) if isinstance(loaded, (list, tuple)) else [loaded]
