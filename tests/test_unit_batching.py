"""The batching rules as pure functions: signature, pick, hold_until, remove, stats."""

import collections

from modelwarden.shared.config import BatchingConfig
from modelwarden.shared.protocol import InferRequest, TensorDesc
from modelwarden.supervisor import batching
from modelwarden.supervisor.requests import Request


def parsed(*shapes, dtype="float32", tree=None) -> InferRequest:
    descs = [TensorDesc(dtype, tuple(shape), 0, frame=index) for index, shape in enumerate(shapes)]
    return InferRequest(1, "m", tree if tree is not None else list(range(len(shapes))), descs,
                        None, None)


def request(rid: int, key=("k",), rows: int = 1, arrived: float = 0.0, deadline: float = 100.0,
            under_load: bool = True) -> Request:
    req = Request(rid, None, [], rid, "m", b"", [], 0, deadline)
    req.batch_key, req.rows, req.arrived, req.queued_under_load = key, rows, arrived, under_load
    return req


def test_signature_ignores_the_batch_dimension_only():
    a, rows_a = batching.signature(parsed([2, 8], [2, 3]), 0)
    b, rows_b = batching.signature(parsed([5, 8], [5, 3]), 0)
    assert a == b and (rows_a, rows_b) == (2, 5)
    assert batching.signature(parsed([2, 8], [2, 4]), 0)[0] != a  # another non-batch dim
    assert batching.signature(parsed([2, 8], [2, 3], dtype="float64"), 0)[0] != a
    assert batching.signature(parsed([2, 8], [2, 3], tree={"dict": {"a": 0, "b": 1}}), 0)[0] != a
    assert batching.signature(parsed([3, 2, 8]), 1)[1] == 2  # dim 1


def test_requests_that_cannot_be_split_have_no_signature():
    assert batching.signature(parsed([2, 8], [3, 8]), 0) is None  # disagree on rows
    assert batching.signature(parsed([]), 0) is None  # a 0-d tensor has no batch dimension
    assert batching.signature(parsed([4]), 1) is None
    assert batching.signature(parsed(), 0) is None  # no tensors at all


def test_pick_takes_compatible_requests_in_order_up_to_the_caps():
    queue = collections.deque([request(1), request(2, key=("other",)), request(3), request(4)])
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=16))] == [1, 3, 4]
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=2))] == [1, 3]
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=1))] == [1]


def test_pick_respects_max_rows_and_skips_what_must_run_alone():
    queue = collections.deque([request(1, rows=3), request(2, rows=3), request(3, rows=2)])
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=8, max_rows=5))] == [1, 3]
    queue[2].alone = True
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=8, max_rows=5))] == [1]
    queue[0].alone = True
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=8))] == [1]
    assert [r.rid for r in batching.pick(collections.deque([request(9, key=None), request(10, key=None)]),
                                         BatchingConfig(max_size=8))] == [9]


def test_a_partial_batch_waits_only_under_load_and_never_past_a_deadline():
    config = BatchingConfig(max_size=4, max_delay_us=2000)
    assert batching.hold_until([request(1, arrived=10.0)], config) == 10.002
    assert batching.hold_until([request(1, arrived=10.0, under_load=False)], config) is None
    assert batching.hold_until([request(1, arrived=10.0), request(2, deadline=10.001)],
                               config) == 10.001
    full = [request(rid, arrived=10.0) for rid in range(4)]
    assert batching.hold_until(full, config) is None
    assert batching.hold_until([request(1)], BatchingConfig(max_size=4)) is None
    assert batching.hold_until([request(1, rows=5)],
                               BatchingConfig(max_size=4, max_delay_us=10, max_rows=5)) is None


def test_remove_takes_prefixes_and_scattered_members():
    items = [request(rid) for rid in range(5)]
    queue = collections.deque(items)
    batching.remove(queue, items[:2])
    assert [r.rid for r in queue] == [2, 3, 4]
    batching.remove(queue, [items[2], items[4]])
    assert [r.rid for r in queue] == [3]


def test_stats_count_batches_and_sizes():
    stats = batching.BatchStats()
    for size in (1, 4, 4, 16):
        stats.record(size)
    view = stats.view()
    assert view == {"batches": 4, "requests": 25, "mean_size": 6.25, "max_size": 16,
                    "histogram": {"1": 1, "4": 2, "16": 1}}
