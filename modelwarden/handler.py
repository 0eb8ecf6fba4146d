"""A model with its own pre- and postprocessing: subclass ``Handler`` and name it in the config
(``source = "handler:module:Class"``). docs/HANDLERS.md maps these hooks onto TorchServe's,
LitServe's, mosec's, KServe's and Triton's.

Every hook runs in the worker: pinned to its cores, with its own thread count, probed like any
model. For a batch the worker calls ``preprocess`` once per request, joins the tensors along the
batch dimension (padding them to a common length when ``[models.batching] buckets`` are set),
calls ``forward`` once, splits the outputs by request and calls ``postprocess`` once per request.
So one request's bad input fails only that request: ``BadInput`` from a hook answers it
BAD_INPUT with your message, any other exception MODEL_ERROR; its batch mates are not touched.
"""

from __future__ import annotations

from typing import Any


class BadInput(ValueError):
    """Raised by a hook for an input the model cannot take; the client gets BAD_INPUT with
    this message (and no traceback)."""


class Handler:
    """The four hooks, each with a default: override the ones your model needs."""

    model: Any = None

    def load(self, device, threads: int, **kwargs: Any) -> None:
        """Build ``self.model`` (and anything the other hooks need) on ``device`` (a
        torch.device); ``threads`` is the worker's intra-op thread count, already set;
        ``kwargs`` are the model's ``kwargs`` from the config. Runs once per worker."""
        raise NotImplementedError(f"{type(self).__name__} must define load()")

    def preprocess(self, inputs: Any) -> Any:
        """One request's inputs as the client sent them -- a value, a list/tuple of values or
        a dict by name; text arrives as (lists of) ``str``, bytes as ``bytes``, tensors as
        tensors -- into tensors for ``forward``: one tensor, a tuple, or a dict by name, each
        with this request's rows along the batch dimension. Default: the inputs unchanged."""
        return inputs

    def forward(self, batch: Any) -> Any:
        """Every request's tensors joined along the batch dimension (the structure
        ``preprocess`` returned) -> outputs with the same rows: a tensor, a tuple or a dict.
        Default: ``self.model`` called with the batch (by keyword for a dict)."""
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, (tuple, list)):
            return self.model(*batch)
        return self.model(batch)

    def postprocess(self, outputs: Any) -> Any:
        """One request's share of the outputs (its rows only; and for outputs named in
        ``keep_length``, its own length only) -> what is sent back: tensors, numpy arrays,
        str or bytes (or lists of them), int/float/bool, nested in lists, tuples or dicts.
        Default: the outputs unchanged."""
        return outputs
