"""What a worker runs for one request or a batch of them, a model with a handler or without.

    member(value)  per request: the handler's ``preprocess`` (none for a plain model), then the
                   length checks of ``[models.batching] buckets`` -> a Member (its tensors)
    run(members)   join every member's tensors along the batch dimension (padding the inputs
                   named in ``pad`` to the longest member along ``length_dim``, and building the
                   ``mask`` where preprocess gave none), one forward, split the outputs back by
                   member (rows, and for ``keep_length`` outputs the member's own length), then
                   per member the handler's ``postprocess``

A member's answer never depends on its batch mates: a padded position is masked, and every
output a member gets back holds only its own rows and length. Failures stay per member: ``member``
raises for its request alone, and ``run`` gives each member its outputs or its own exception (a
postprocess that raises); a forward that raises fails the whole call, and the caller (worker/
serve.py) then runs each member alone.
"""

from __future__ import annotations

import bisect
import time
from typing import Any, NamedTuple

import torch

from modelwarden.handler import BadInput, Handler
from modelwarden.shared.codec import element_leaf, flatten, unflatten
from modelwarden.shared.config import BatchingConfig
from modelwarden.shared.protocol import MODEL_ERROR, ProtocolError


class Member(NamedTuple):
    """One request, ready to be joined: the structure ``forward`` takes and its tensors."""

    tree: Any  # the codec TREE of the tensors
    tensors: list  # leaves in TREE order
    names: list  # per leaf, its input name (a dict key) or None
    rows: int  # its size along the batch dimension
    length: int | None  # its size along length_dim of the padded inputs (None: no buckets)


class Outputs(NamedTuple):
    """One member's answer, ready to encode: a TREE and its leaves."""

    tree: Any
    leaves: list


# Per request, the two tuples are built as tuple.__new__ builds them: a NamedTuple's own __new__
# is generated Python source, an interpreted frame (about 2,000 instructions) even when this
# module is compiled.
def new_member(tree: Any, tensors: list, names: list, rows: int, length: int | None) -> Member:
    return tuple.__new__(Member, (tree, tensors, names, rows, length))


def new_outputs(tree: Any, leaves: list) -> Outputs:
    return tuple.__new__(Outputs, (tree, leaves))


class Pipeline:
    """The worker's model, handler or plain callable, as members in and outputs out."""

    def __init__(self, model: Any, batching: BatchingConfig) -> None:
        self.handler: Handler | None = model if isinstance(model, Handler) else None
        self.model = model
        self.batching = batching
        self.dim = batching.dim
        self.padded = dict(batching.pad)
        self.keep_length = set(batching.keep_length)
        # Read per request: plain attributes, not the config's (interpreted) property.
        self.bucketed = batching.bucketed
        self.mask = batching.mask

    @property
    def inner_model(self) -> Any:
        """The module the ``prepare`` steps apply to: a handler's ``model``, or the model."""
        return self.handler.model if self.handler is not None else self.model

    def replace_model(self, model: Any) -> None:
        if self.handler is not None:
            self.handler.model = model
        else:
            self.model = model

    # -- one request ------------------------------------------------------------------------

    def from_request(self, tree: Any, leaves: list) -> Member:
        """A decoded request (its input TREE and leaves) as a Member: through the handler's
        preprocess if there is one, as it is for a plain model."""
        if self.handler is not None:
            return self.member(unflatten(tree, leaves))
        return self._member(tree, leaves)

    def member(self, value: Any) -> Member:
        """One request's inputs (the value the client sent) as a Member. Raises BadInput (or
        the handler's own exception) for this request alone."""
        leaves: list = []
        if self.handler is None:
            return self._member(_flatten_request(value, leaves), leaves)
        value = self.handler.preprocess(value)
        try:
            tree = flatten(value, leaves)
        except TypeError as exc:
            raise TypeError(f"preprocess must return tensors: {exc}") from None
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError("preprocess must return tensors (a tensor, a tuple or a dict)")
        return self._member(tree, leaves)

    def _member(self, tree: Any, leaves: list) -> Member:
        names = _leaf_names(tree, len(leaves))
        leaves, length = self._fit_length(leaves, names)
        rows = _rows(leaves, self.dim)
        return new_member(tree, leaves, names, rows, length)

    def _fit_length(self, leaves: list, names: list) -> tuple[list, int | None]:
        """The member's length along ``length_dim`` (its padded inputs must agree on it), cut to
        the last bucket or refused when it is longer, as the config says."""
        if not self.bucketed:
            return leaves, None
        axis = self.batching.length_dim
        lengths = {leaf.shape[axis] for leaf, name in zip(leaves, names)
                   if name in self.padded and isinstance(leaf, torch.Tensor) and leaf.dim() > axis}
        if not lengths:
            return leaves, None
        if len(lengths) > 1:
            raise BadInput(f"the padded inputs {sorted(self.padded)} disagree on their length "
                           f"along dim {axis}: {sorted(lengths)}")
        length = lengths.pop()
        last = self.batching.buckets[-1]
        if length <= last:
            return leaves, length
        if self.batching.too_long == "refuse":
            raise BadInput(f"length {length} along dim {axis} is past the last bucket ({last})")
        cut = [leaf.narrow(axis, 0, last) if name in self.padded else leaf
               for leaf, name in zip(leaves, names)]
        return cut, last

    # -- a call -----------------------------------------------------------------------------

    def run(self, members: list[Member]) -> tuple[list, int]:
        """One forward for ``members``: per member its Outputs or the exception its own
        postprocess raised, and the forward's time in microseconds. Raises when the join or the
        forward fails (then no member has an answer yet)."""
        if len(members) == 1 and not self._builds_mask(members[0]):
            tree, joined = members[0].tree, members[0].tensors  # alone: nothing to join or pad
        else:
            tree, joined = self.join(members)
        started = time.perf_counter_ns()
        outputs = self.forward(tree, joined)
        compute_us = (time.perf_counter_ns() - started) // 1000
        leaves: list = []
        out_tree = _flatten_outputs(outputs, leaves)
        shares = self.split(leaves, members, joined) if len(members) > 1 else [leaves]
        if self.bucketed and len(members) > 1:
            shares = [self._own_length(out_tree, share, member)
                      for share, member in zip(shares, members)]
        return [self._post(out_tree, share) for share in shares], compute_us

    def forward(self, tree: Any, tensors: list) -> Any:
        value = unflatten(tree, tensors)
        if self.handler is not None:
            return self.handler.forward(value)
        args, kwargs = call_arguments(tree, value)
        return self.model(*args, **kwargs)

    def _post(self, tree: Any, share: list) -> "Outputs | Exception":
        if self.handler is None:
            return new_outputs(tree, share)
        try:
            value = self.handler.postprocess(unflatten(tree, share))
            leaves: list = []
            return new_outputs(flatten(_sendable(value), leaves), leaves)
        except Exception as exc:  # this member's alone: its batch mates keep their answers
            return exc

    # -- joining and splitting --------------------------------------------------------------

    def _builds_mask(self, member: Member) -> bool:
        """Whether ``join`` adds the configured mask: a bucketed model's dict inputs lack it."""
        mask = self.mask
        return (mask is not None and member.length is not None and mask not in member.names
                and isinstance(member.tree, dict) and "dict" in member.tree)

    def join(self, members: list[Member]) -> tuple[Any, list]:
        """Every member's tensors joined along the batch dimension: the padded inputs at the
        longest member's length (one copy each, into a tensor filled with the pad value), the
        others concatenated; the mask built where the members carry none."""
        first = members[0]
        if any(member.tree != first.tree or len(member.tensors) != len(first.tensors)
               for member in members):
            raise ValueError("batch members disagree on their inputs")
        longest = max((member.length or 0) for member in members)
        joined = []
        for index, name in enumerate(first.names):
            parts = [member.tensors[index] for member in members]
            if self.bucketed and name in self.padded and first.length is not None:
                joined.append(_pad_join(parts, self.dim, self.batching.length_dim, longest,
                                        self.padded[name]))
            else:
                joined.append(torch.cat(parts, self.dim))
        tree = first.tree
        mask = self.batching.mask
        if self._builds_mask(first):
            joined.append(self._built_mask(members, longest, joined))
            tree = {"dict": {**tree["dict"], mask: len(joined) - 1}}
        return tree, joined

    def _built_mask(self, members: list[Member], longest: int, joined: list) -> torch.Tensor:
        """1 over each member's own positions, 0 over its padding: [rows, longest]."""
        device = joined[0].device if joined else None
        mask = torch.zeros((sum(member.rows for member in members), longest), dtype=torch.int64,
                           device=device)
        start = 0
        for member in members:
            mask[start:start + member.rows, :member.length or longest] = 1
            start += member.rows
        return mask

    def split(self, leaves: list, members: list[Member], joined: list) -> list[list]:
        """Per member, its rows of every output: views along the batch dimension, no copy. An
        output that *is* a joined input gives each member its own input tensor back."""
        rows = [member.rows for member in members]
        total = sum(rows)
        pieces = []
        for index, leaf in enumerate(leaves):
            tensor = leaf if isinstance(leaf, torch.Tensor) else torch.from_numpy(leaf)
            same = next((k for k, whole in enumerate(joined) if tensor is whole), None)
            if same is not None and same < len(members[0].tensors):
                pieces.append([member.tensors[same] for member in members])
                continue
            if tensor.dim() <= self.dim or tensor.shape[self.dim] != total:
                raise ValueError(f"output {index} has shape {list(tensor.shape)}: not {total} rows "
                                 f"along dim {self.dim}, so it cannot be split by member")
            pieces.append(torch.split(tensor, rows, self.dim))
        return [[piece[member] for piece in pieces] for member in range(len(rows))]

    def _own_length(self, tree: Any, share: list, member: Member) -> list:
        """The member's share with every ``keep_length`` output cut to its own length."""
        if not self.keep_length or member.length is None:
            return share
        names = _leaf_names(tree, len(share))
        axis = self.batching.length_dim
        return [leaf.narrow(axis, 0, member.length)
                if name in self.keep_length and leaf.dim() > axis and leaf.shape[axis] > member.length
                else leaf for leaf, name in zip(share, names)]

    # -- warm-up ----------------------------------------------------------------------------

    def warm_up_shapes(self) -> list[tuple[str, int, int | None]]:
        """(label, rows, length) of every shape the warm-up runs: each bucket (or the example's
        own length) at batch size 1 and at ``max_size``."""
        sizes = sorted({1, self.batching.max_size})
        lengths: list[int | None] = list(self.batching.buckets) or [None]
        return [(str(length) if length is not None else "any", rows, length)
                for length in lengths for rows in sizes]

    def shaped(self, template: Member, rows: int, length: int | None) -> Member:
        """``template`` (a member built from the example input) at ``rows`` rows and, for the
        padded inputs, ``length`` positions: its first row repeated, its length cut or padded
        (a built or padded mask marks every position real, so the forward costs what a real
        request of that length costs)."""
        tensors = []
        for tensor, name in zip(template.tensors, template.names):
            if tensor.dim() > self.dim and template.rows:
                tensor = tensor.narrow(self.dim, 0, 1)
                tensor = tensor.repeat_interleave(rows, self.dim) if rows > 1 else tensor
            if length is not None and name in self.padded and tensor.dim() > self.batching.length_dim:
                fill = 1 if name == self.batching.mask else self.padded[name]
                tensor = _resize(tensor, self.batching.length_dim, length, fill)
            tensors.append(tensor)
        new_length = length if template.length is not None else None
        return Member(template.tree, tensors, template.names, rows if template.rows else 0,
                      new_length)

    def bucket_of(self, length: int) -> int:
        return min(bisect.bisect_left(self.batching.buckets, length), len(self.batching.buckets) - 1)


# -- helpers ------------------------------------------------------------------------------------


def call_arguments(tree: Any, value: Any) -> tuple[tuple, dict]:
    """A plain model's call: a dict tree by keyword, a single tensor alone, a list positionally."""
    if isinstance(tree, dict) and "dict" in tree:
        return (), value
    if isinstance(tree, int):
        return (value,), {}
    return tuple(value), {}


def _flatten_request(value: Any, leaves: list, depth: int = 0) -> Any:
    """A request's inputs as a TREE and its leaves, as the worker decodes them off the wire:
    tensors, and str/bytes values (lists of them) as they are -- not in their wire form."""
    if depth > 16:
        raise TypeError("value nests deeper than 16 levels")
    if isinstance(value, tuple):  # positional arguments (the probe's, the warm-up's)
        return {"tuple": [_flatten_request(item, leaves, depth + 1) for item in value]}
    if isinstance(value, torch.Tensor) or element_leaf(value) is not None:
        leaves.append(value)
        return len(leaves) - 1
    if isinstance(value, list):
        return [_flatten_request(item, leaves, depth + 1) for item in value]
    if isinstance(value, dict):
        return {"dict": {key: _flatten_request(item, leaves, depth + 1)
                         for key, item in value.items()}}
    return flatten(value, leaves)  # numpy arrays; anything else is refused there


def _leaf_names(tree: Any, count: int) -> list:
    """Per leaf, the dict key it sits under at the top level (None elsewhere)."""
    names: list = [None] * count
    if isinstance(tree, dict) and "dict" in tree:
        for name, node in tree["dict"].items():
            if isinstance(node, int):
                names[node] = name
    return names


def _rows(leaves: list, dim: int) -> int:
    first = leaves[0] if leaves else None
    if isinstance(first, torch.Tensor) and first.dim() > dim:
        return first.shape[dim]
    if isinstance(first, list):
        return len(first)
    return 0


def _pad_join(parts: list, dim: int, axis: int, length: int, value: float) -> torch.Tensor:
    """``parts`` joined along ``dim``, each padded with ``value`` to ``length`` along ``axis``:
    one tensor filled once, each part copied into its corner."""
    first = parts[0]
    shape = list(first.shape)
    shape[dim] = sum(part.shape[dim] for part in parts)
    shape[axis] = length
    out = torch.full(shape, value, dtype=first.dtype, device=first.device)
    start = 0
    for part in parts:
        rows = part.shape[dim]
        out.narrow(dim, start, rows).narrow(axis, 0, part.shape[axis]).copy_(part)
        start += rows
    return out


def _resize(tensor: torch.Tensor, axis: int, length: int, fill: float) -> torch.Tensor:
    have = tensor.shape[axis]
    if have >= length:
        return tensor.narrow(axis, 0, length)
    shape = list(tensor.shape)
    shape[axis] = length
    out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    out.narrow(axis, 0, have).copy_(tensor)
    return out


def _flatten_outputs(outputs: Any, leaves: list) -> Any:
    try:
        return flatten(outputs, leaves)
    except TypeError as exc:
        raise ProtocolError(MODEL_ERROR, f"model output cannot travel: {exc}") from None


def _sendable(value: Any, depth: int = 0) -> Any:
    """A postprocess result with its Python numbers as 0-d tensors (the wire carries tensors,
    str and bytes)."""
    if depth > 16:
        return value
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    if isinstance(value, dict):
        return {key: _sendable(item, depth + 1) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_sendable(item, depth + 1) for item in value)
    if isinstance(value, list) and value and not all(isinstance(item, (str, bytes)) for item in value):
        return [_sendable(item, depth + 1) for item in value]
    return value
