"""The batching rules as pure functions: signature, pick, hold_until, remove, stats."""

import collections

from modelwarden.shared.config import BatchingConfig
from modelwarden.shared.protocol import InferRequest, TensorDesc
from modelwarden.supervisor.routing import batching
from modelwarden.supervisor.routing.requests import Request


def parsed(*shapes, dtype="float32", tree=None) -> InferRequest:
    descs = [TensorDesc(dtype, tuple(shape), 0, frame=index) for index, shape in enumerate(shapes)]
    return InferRequest(1, "m", tree if tree is not None else list(range(len(shapes))), descs,
                        None, None)


DIM0, DIM1 = BatchingConfig(), BatchingConfig(dim=1)
TEXT_BUCKETS = BatchingConfig(max_size=8, buckets=[16, 32, 64], pad={"ids": 0},
                              bytes_per_token=4.0)


def request(rid: int, key=("k",), rows: int = 1, arrived: float = 0.0, deadline: float = 100.0,
            under_load: bool = True) -> Request:
    req = Request(rid, None, [], rid, "m", b"", [], 0, deadline)
    req.batch_key, req.rows, req.arrived, req.queued_under_load = key, rows, arrived, under_load
    return req


def test_signature_ignores_the_batch_dimension_only():
    a, rows_a = batching.signature(parsed([2, 8], [2, 3]), DIM0)
    b, rows_b = batching.signature(parsed([5, 8], [5, 3]), DIM0)
    assert a == b and (rows_a, rows_b) == (2, 5)
    assert batching.signature(parsed([2, 8], [2, 4]), DIM0)[0] != a  # another non-batch dim
    assert batching.signature(parsed([2, 8], [2, 3], dtype="float64"), DIM0)[0] != a
    assert batching.signature(parsed([2, 8], [2, 3], tree={"dict": {"a": 0, "b": 1}}), DIM0)[0] != a
    assert batching.signature(parsed([3, 2, 8]), DIM1)[1] == 2  # dim 1


def test_a_signature_is_worked_out_once_per_header_and_config():
    """Requests InferCache parses from one header share what is derived from it; another config
    (a reload) or the handler flag works it out again."""
    from modelwarden.shared.protocol import InferCache, pack, parse_infer, unpack_header

    def header(request_id):
        return pack({"type": "infer", "id": request_id, "model": "m", "inputs": 0,
                     "tensors": [{"dtype": "float32", "shape": [3, 2, 8], "frame": 0}]})

    cache = InferCache()
    first = parse_infer(unpack_header(header(1)), 1)
    cache.learn(header(1), first, 1)
    second = cache.parse(header(2), 1)
    assert second is not None and second.id == 2 and second.derived is first.derived
    key0 = batching.signature(first, DIM0)
    assert batching.signature(second, DIM0) is key0  # remembered, not worked out again
    assert key0[1] == 3 and batching.signature(second, DIM1)[1] == 2  # another config
    assert batching.signature(second, DIM0, handler=True)[1] == 3
    assert batching.signature(parsed([3, 2, 8]), DIM1)[1] == 2  # a header of its own


def test_requests_that_cannot_be_split_have_no_signature():
    assert batching.signature(parsed([2, 8], [3, 8]), DIM0) is None  # disagree on rows
    assert batching.signature(parsed([]), DIM0) is None  # a 0-d tensor has no batch dimension
    assert batching.signature(parsed([4]), DIM1) is None
    assert batching.signature(parsed(), DIM0) is None  # no tensors at all
    for element in ("str", "bytes"):  # str/bytes become tensors only in a handler's preprocess
        assert batching.signature(parsed([4], dtype=element), DIM0) is None


def test_pick_batches_requests_whose_signatures_are_equal_but_not_the_same_object():
    """Requests of one header share one signature object; two clients' headers of the same
    shape each have their own, equal ones, and batch together all the same."""
    queue = collections.deque([request(1, key=tuple(["k", 8])), request(2, key=tuple(["k", 8])),
                               request(3, key=tuple(["other", 8]))])
    assert queue[0].batch_key is not queue[1].batch_key
    assert [r.rid for r in batching.pick(queue, BatchingConfig(max_size=16))] == [1, 2]


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


def test_buckets_key_a_padded_input_by_the_bucket_of_its_length_not_its_size():
    named = {"dict": {"ids": 0, "scale": 1}}
    short, rows = batching.signature(parsed([1, 10], [1, 3], tree=named), TEXT_BUCKETS)
    assert rows == 1
    assert batching.signature(parsed([2, 15], [2, 3], tree=named), TEXT_BUCKETS)[0] == short
    assert batching.signature(parsed([1, 17], [1, 3], tree=named), TEXT_BUCKETS)[0] != short
    # past the last edge: the last bucket (the worker truncates or refuses)
    assert (batching.signature(parsed([1, 500], [1, 3], tree=named), TEXT_BUCKETS)[0]
            == batching.signature(parsed([1, 64], [1, 3], tree=named), TEXT_BUCKETS)[0])
    # an input not named in pad still must agree on every non-batch dimension
    assert batching.signature(parsed([1, 10], [1, 4], tree=named), TEXT_BUCKETS)[0] != short
    # without buckets a length difference is a shape difference
    assert (batching.signature(parsed([1, 10], tree={"dict": {"ids": 0}}), DIM0)[0]
            != batching.signature(parsed([1, 11], tree={"dict": {"ids": 0}}), DIM0)[0])


def test_a_handlers_text_requests_are_keyed_by_their_longest_element_in_tokens():
    def text(count: int, longest: int):
        desc = TensorDesc("str", (count,), 4 * count + longest, frame=0, longest=longest)
        return InferRequest(1, "m", 0, [desc], None, None)

    key, rows = batching.signature(text(3, 40), TEXT_BUCKETS, handler=True)
    assert rows == 3
    assert batching.signature(text(9, 64), TEXT_BUCKETS, handler=True)[0] == key  # 16 tokens
    assert batching.signature(text(1, 65), TEXT_BUCKETS, handler=True)[0] != key  # 17 tokens
