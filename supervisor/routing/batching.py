"""Dynamic batching: which queued requests may share one forward pass, and when a batch goes.

The rule (Triton's ``max_queue_delay = 0`` default, and "a lone request never waits"):

- While a worker of the model has room, requests go at the end of the supervisor's poll round
  they arrived in: a lone one alone, those that arrived together (clients answered together
  send again together) as one batch. The round ends once its handlers have run, so batching
  never adds more than that to an idle pool's latency.
- When a worker frees up and requests are queued, it takes the head of the queue and every
  queued request *compatible* with it, in arrival order, up to ``max_size`` requests and
  ``max_rows`` summed rows along the batch dimension.
- With ``max_delay_us > 0``, a partial batch whose head was queued under load may wait for more
  until ``max_delay_us`` after the head arrived, and never past any member's deadline.
- A request that was in flight in a batch when its worker died runs alone from then on
  (``Request.alone``): a poison input then dies alone and takes no batch mate with it.

Two requests are compatible when their signatures are equal: the same input tree (names and
nesting), and per tensor the same dtype and the same shape except along ``dim``. A request
whose tensors are not all at least ``dim + 1``-dimensional, or disagree on their size along
``dim``, or (for a plain model) that holds a str/bytes input, has no signature and always
runs alone: its elements only become tensors inside the worker. Everything here is pure: the router calls it.

Length buckets (``buckets``): the inputs named in ``pad`` may differ along ``length_dim``; the
signature then holds the *bucket* of the request's length instead of that size, so requests of
one bucket share a forward pass and the worker pads them to the longest (worker/pipeline.py). A
model with a handler preprocesses in the worker, so the supervisor cannot see the tensors its
forward takes: its requests are compatible when their input trees and element types agree
(the handler's tensors must then join; a batch that does not runs each member alone), and their
bucket comes from what the header shows without decoding anything -- a padded tensor input's
size along ``length_dim``, or a text input's longest element in bytes / ``bytes_per_token``.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Any, Iterable

from modelwarden.shared.config import BatchingConfig
from modelwarden.shared.protocol import ELEMENT_TYPES, InferRequest

# How far down the queue a batch looks for compatible requests: bounds the work per dispatch
# when the head's signature is rare.
SCAN_LIMIT = 512


def signature(parsed: InferRequest, config: BatchingConfig,
              handler: bool = False) -> tuple[tuple, int] | None:
    """(signature, rows) of a request, or None if it cannot be batched. A function of the
    header but for its id, and of ``config`` and ``handler``: worked out once per header
    (``parsed.derived``, which InferCache's requests of one header share) and per config."""
    known = parsed.derived.get("batching")
    if known is not None and known[0] is config and known[1] == handler:
        return known[2]
    found = _handler_signature(parsed, config) if handler else _tensor_signature(parsed, config)
    parsed.derived["batching"] = (config, handler, found)
    return found


def _tensor_signature(parsed: InferRequest, config: BatchingConfig) -> tuple[tuple, int] | None:
    """A plain model's request: every input has the batch dimension, the same rows."""
    if any(desc.dtype in ELEMENT_TYPES for desc in parsed.tensors):
        return None  # a plain model's str/bytes input: nothing in the worker would join it
    dim = config.dim
    bucketed = _padded_indices(parsed, config) if config.buckets else set()
    rows = None
    shapes = []
    length = None
    for index, desc in enumerate(parsed.tensors):
        shape = desc.shape
        if len(shape) <= dim:
            return None
        if rows is None:
            rows = shape[dim]
        elif shape[dim] != rows:
            return None
        if index in bucketed and len(shape) > config.length_dim:
            length = max(length or 0, shape[config.length_dim])
            shape = shape[:config.length_dim] + (-1,) + shape[config.length_dim + 1:]
        shapes.append((desc.dtype, shape[:dim], shape[dim + 1:]))
    if rows is None:
        return None
    bucket = bucket_of(length, config.buckets) if length is not None else None
    return (_freeze(parsed.tree), tuple(shapes), bucket), rows


def _handler_signature(parsed: InferRequest, config: BatchingConfig) -> tuple[tuple, int] | None:
    """A handler's request: its rows are its first input's size along dim 0 (texts, images),
    its bucket the longest thing the header shows."""
    if not parsed.tensors or not parsed.tensors[0].shape:
        return None
    rows = parsed.tensors[0].shape[0]
    length = None
    if config.buckets:
        padded = _padded_indices(parsed, config)
        for index, desc in enumerate(parsed.tensors):
            longest = getattr(desc, "longest", None)
            if longest is not None:  # text or bytes: tokens estimated from bytes
                length = max(length or 0, math.ceil(longest / config.bytes_per_token))
            elif index in padded and len(desc.shape) > config.length_dim:
                length = max(length or 0, desc.shape[config.length_dim])
    bucket = bucket_of(length, config.buckets) if length is not None else None
    dtypes = tuple(desc.dtype for desc in parsed.tensors)
    return (_freeze(parsed.tree), dtypes, bucket), rows


def _padded_indices(parsed: InferRequest, config: BatchingConfig) -> set[int]:
    """The descriptor indices of the inputs named in ``pad`` (a dict tree's top-level keys)."""
    tree = parsed.tree
    if not (isinstance(tree, dict) and isinstance(tree.get("dict"), dict)):
        return set()
    return {node for name, node in tree["dict"].items() if name in config.pad and isinstance(node, int)}


def bucket_of(length: int, buckets: list[int]) -> int:
    """The index of the first bucket edge at or above ``length``; past the last, the last (the
    worker truncates or refuses such a member)."""
    return min(bisect.bisect_left(buckets, length), len(buckets) - 1)


def _freeze(tree: Any) -> Any:
    if isinstance(tree, dict):
        return tuple(sorted((key, _freeze(value)) for key, value in tree.items()))
    if isinstance(tree, list):
        return ("list", *(_freeze(item) for item in tree))
    return tree


def pick(queue: Iterable, config: BatchingConfig) -> list:
    """The head of the queue and its compatible followers, within the size and row caps."""
    iterator = iter(queue)
    head = next(iterator)
    members = [head]
    # Read once: the config is a pydantic object, whose attribute reads cost more than the scan.
    max_size = config.max_size
    if head.batch_key is None or head.alone or max_size == 1:
        return members
    max_rows = config.max_rows
    key = head.batch_key
    rows = head.rows
    scanned = 0
    for request in iterator:
        if len(members) >= max_size or scanned >= SCAN_LIMIT:
            break
        scanned += 1
        if request.done or request.alone:
            continue
        # One header's requests share one signature object (``signature``): most compare by
        # identity.
        if request.batch_key is not key and request.batch_key != key:
            continue
        if max_rows and rows + request.rows > max_rows:
            continue
        members.append(request)
        rows += request.rows
    return members


def hold_until(members: list, config: BatchingConfig) -> float | None:
    """When a partial batch may wait for more members, the time to send it anyway; else None."""
    head = members[0]
    if (config.max_delay_us == 0 or len(members) >= config.max_size or head.batch_key is None
            or head.alone or not head.queued_under_load):
        return None
    if config.max_rows and sum(member.rows for member in members) >= config.max_rows:
        return None
    return min(head.arrived + config.max_delay_us / 1e6,
               min(member.deadline for member in members))


def remove(queue: collections.deque, members: list) -> None:
    """Take the members out of the queue; the common case (a prefix) costs a popleft each."""
    count = 0
    size = len(members)
    for request in queue:
        if count == size or request is not members[count]:
            break
        count += 1
    if count == size:
        for _ in range(count):
            queue.popleft()
        return
    taken = set(map(id, members))
    kept = [request for request in queue if id(request) not in taken]
    queue.clear()
    queue.extend(kept)


class BatchStats:
    """What status shows per model: batches run, their mean and max size, a size histogram."""

    def __init__(self) -> None:
        self.batches = 0
        self.requests = 0
        self.largest = 0
        self.histogram: collections.Counter = collections.Counter()

    def record(self, size: int) -> None:
        self.batches += 1
        self.requests += size
        self.largest = max(self.largest, size)
        self.histogram[size] += 1

    def view(self) -> dict:
        return {"batches": self.batches, "requests": self.requests,
                "mean_size": round(self.requests / self.batches, 2) if self.batches else 0.0,
                "max_size": self.largest,
                "histogram": {str(size): count for size, count in sorted(self.histogram.items())}}
