"""Prepared models: the ``[models.prepare]`` steps, and the FP32 hold that judges them.

Steps, in the order ``prepare`` applies them (shared/config.PrepareConfig.steps names them):

  ``dtype``    the weights cast to bfloat16 or float16; a wrapper casts floating inputs to it and
               floating outputs back to float32, so clients, the batcher and the probe's golden
               see the dtypes of the model as it was loaded
  ``freeze``   torch.jit.freeze then torch.jit.optimize_for_inference (TorchScript only: an
               nn.Module from python: or export: has no graph to freeze)
  ``compile``  torch.compile with the configured mode; it compiles on the first call, which the
               hold makes, so a compile failure is a boot failure, never a first request's

A cast before freeze makes the frozen constants reduced too; compile comes last because it
traces whatever the others made. The worker (worker/main.py) holds the result to the answers of
the model as loaded before it may go READY: ``hold_to_reference``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from modelwarden.shared.codec import TORCH_DTYPES
from modelwarden.shared.config import PrepareConfig


class PrepareError(RuntimeError):
    """A step could not be applied or run; the message names it (shown in ``modelwarden status``)."""


class ReducedPrecision:
    """The model in ``dtype``, called with what the model as loaded is called with: floating
    inputs cast to ``dtype``, floating outputs cast back to float32."""

    def __init__(self, model: Callable, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(cast_floating(value, self.dtype) for value in args)
        kwargs = {key: cast_floating(value, self.dtype) for key, value in kwargs.items()}
        return cast_floating(self.model(*args, **kwargs), torch.float32)


def prepare(model: Callable, config: PrepareConfig, device: torch.device) -> Callable:
    """The model with ``config``'s steps applied (the model itself when there are none).
    ``device`` is where the model already is: a cast keeps it there. Raises PrepareError."""
    dtype = TORCH_DTYPES[config.dtype]
    if dtype != torch.float32:
        model = _step(f"dtype={config.dtype}", _cast, model, dtype)
    if config.freeze:
        model = _step("freeze", _freeze, model)
    if config.compile_mode is not None:
        model = _step(f"compile(mode={config.compile_mode})", _compile, model, config.compile_mode)
    return ReducedPrecision(model, dtype) if dtype != torch.float32 else model


def _step(name: str, apply: Callable, model: Callable, *args: Any) -> Callable:
    try:
        return apply(model, *args)
    except PrepareError as exc:
        raise PrepareError(f"{name}: {exc}") from None
    except Exception as exc:
        raise PrepareError(f"{name}: {type(exc).__name__}: {exc}") from exc


def _cast(model: Callable, dtype: torch.dtype) -> Callable:
    if not isinstance(model, torch.nn.Module):
        raise PrepareError(f"the source gave a {type(model).__name__}, not an nn.Module: its "
                           "weights cannot be cast")
    return model.to(dtype)


def _freeze(model: Callable) -> Callable:
    if not isinstance(model, torch.jit.ScriptModule):
        raise PrepareError(f"the source gave a {type(model).__name__}, not a TorchScript module")
    return torch.jit.optimize_for_inference(torch.jit.freeze(model.eval()))


def _compile(model: Callable, mode: str) -> Callable:
    return torch.compile(model, mode=mode)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it (nested in tuples, lists, dicts) cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def output_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested output, in order (dicts in their order); numpy arrays become
    tensors, anything else is left out."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in output_leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in output_leaves(item)]
    if hasattr(value, "__array__") and hasattr(value, "dtype"):
        return [torch.as_tensor(value)]
    return []


def hold_to_reference(reference_outputs: Any, outputs: Any, atol: float,
                      rtol: float) -> tuple[bool, float]:
    """(every output within ``|out - ref| <= atol + rtol * |ref|``, the largest ``|out - ref|``).

    Both sides are flattened to their tensors in order, so a golden file's list of arrays holds
    a model that returns a tuple or a dict. A different count or shape, or a NaN where the
    reference has none, is a miss with an infinite difference."""
    expected, actual = output_leaves(reference_outputs), output_leaves(outputs)
    if len(expected) != len(actual):
        return False, math.inf
    ok, worst = True, 0.0
    for reference, output in zip(expected, actual):
        if tuple(reference.shape) != tuple(output.shape):
            return False, math.inf
        within, largest = _compare(reference, output, atol, rtol)
        ok, worst = ok and within, max(worst, largest)
    return ok, worst


def _compare(reference: torch.Tensor, output: torch.Tensor, atol: float,
             rtol: float) -> tuple[bool, float]:
    wide = torch.complex128 if reference.is_complex() or output.is_complex() else torch.float64
    ref, out = reference.detach().cpu().to(wide), output.detach().cpu().to(wide)
    if ref.numel() == 0:
        return True, 0.0
    difference = (out - ref).abs()
    both_nan = torch.isnan(ref.abs()) & torch.isnan(out.abs())  # NaN where FP32 has NaN: agreed
    difference = torch.where(both_nan, torch.zeros_like(difference), difference)
    if not torch.isfinite(difference).all():
        return False, math.inf
    within = bool((difference <= atol + rtol * ref.abs().nan_to_num(0.0)).all())
    return within, float(difference.max())
