"""Unit tests of supervisor/routing/requests.py: the retry/poison rule and the declared-input check."""

from __future__ import annotations

import pytest

from modelwarden.shared.config import InputSpec
from modelwarden.shared.protocol import BAD_INPUT, POISON, WORKER_DIED, ProtocolError, TensorDesc
from modelwarden.supervisor.routing.requests import POISON_AFTER_DEATHS, Request, after_worker_death, check_declared


def request() -> Request:
    return Request(rid=1, socket=None, route=[b"peer"], client_id=7, model="m", header_frame=b"",
                   payload=[], received_ns=0, deadline=100.0)


# -- after_worker_death -------------------------------------------------------------------------


def test_first_death_retries_when_retries_are_on():
    req = request()
    req.worker = object()
    assert after_worker_death(req, retries=1) is None
    assert req.deaths == 1
    assert req.worker is None  # no longer held by the dead worker


def test_second_death_is_poison():
    req = request()
    assert after_worker_death(req, retries=1) is None
    req.worker = object()
    assert after_worker_death(req, retries=1) == POISON
    assert req.deaths == POISON_AFTER_DEATHS == 2
    assert req.worker is None


def test_poison_wins_even_with_more_retries_allowed():
    req = request()
    assert after_worker_death(req, retries=5) is None
    assert after_worker_death(req, retries=5) == POISON


def test_without_retries_the_first_death_is_worker_died():
    req = request()
    req.worker = object()
    assert after_worker_death(req, retries=0) == WORKER_DIED
    assert req.deaths == 1 and req.worker is None


# -- check_declared -----------------------------------------------------------------------------


def spec(name: str, dtype: str, shape: list[int]) -> InputSpec:
    return InputSpec(name=name, dtype=dtype, shape=shape)


def t(dtype: str, *shape: int) -> TensorDesc:
    nbytes = {"float32": 4, "int64": 8, "bool": 1, "float16": 2}[dtype]
    for dim in shape:
        nbytes *= dim
    return TensorDesc(dtype, tuple(shape), nbytes, frame=0)


def bad_input(*args) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        check_declared(*args)
    assert info.value.code == BAD_INPUT
    return info.value


X = spec("x", "float32", [-1, 4])
IDS = spec("ids", "int64", [2, -1])


def test_nothing_declared_accepts_anything():
    check_declared([0, 1], [t("bool", 1), t("float16", 9, 9)], None)
    check_declared(0, [t("bool")], [])


@pytest.mark.parametrize("tree, tensors", [
    (0, [t("float32", 3, 4)]),
    ([0], [t("float32", 1, 4)]),
    ({"tuple": [0]}, [t("float32", 1000, 4)]),
    ({"dict": {"x": 0}}, [t("float32", 0, 4)]),
])
def test_single_declared_input_in_every_tree_form(tree, tensors):
    assert check_declared(tree, tensors, [X]) is None


def test_positional_inputs_pair_in_order():
    check_declared([1, 0], [t("int64", 2, 7), t("float32", 5, 4)], [X, IDS])
    error = bad_input([0, 1], [t("int64", 2, 7), t("float32", 5, 4)], [X, IDS])
    assert "'x'" in error.message and "int64" in error.message


def test_named_inputs_pair_by_name_not_order():
    check_declared({"dict": {"ids": 0, "x": 1}}, [t("int64", 2, 3), t("float32", 8, 4)], [X, IDS])


@pytest.mark.parametrize("tree, n", [
    ([0, 1], 2),  # two tensors, one declared
    ([], 0),
    ([[0]], 1),  # nested list is not a tensor
    ({"tuple": [0, 1]}, 2),
])
def test_wrong_count_is_bad_input(tree, n):
    error = bad_input(tree, [t("float32", 1, 4)] * n, [X])
    assert "1 input tensor(s)" in error.message and "x" in error.message


def test_wrong_names_are_bad_input():
    error = bad_input({"dict": {"y": 0}}, [t("float32", 1, 4)], [X])
    assert "['x']" in error.message and "['y']" in error.message
    bad_input({"dict": {"x": 0, "extra": 1}}, [t("float32", 1, 4), t("float32", 1, 4)], [X])
    bad_input({"dict": {"x": 0}}, [t("float32", 1, 4)], [X, IDS])
    bad_input({"dict": {"x": [0]}}, [t("float32", 1, 4)], [X])


def test_wrong_dtype_is_bad_input():
    error = bad_input(0, [t("float16", 1, 4)], [X])
    assert error.message == "input 'x': dtype float16, model takes float32"


@pytest.mark.parametrize("shape", [(4,), (1, 4, 1), (), (1, 5), (1, 3), (4, 1)])
def test_wrong_rank_or_static_dim_is_bad_input(shape):
    error = bad_input(0, [t("float32", *shape)], [X])
    assert "-1 = any" in error.message and "'x'" in error.message


@pytest.mark.parametrize("dims", [(2, 0), (2, 1), (2, 10**6)])
def test_dynamic_dim_accepts_any_size(dims):
    check_declared(0, [t("int64", *dims)], [IDS])


def test_static_dims_must_match_exactly():
    for dims in ((1, 5), (3, 5), (0, 5)):
        bad_input(0, [t("int64", *dims)], [IDS])


def test_scalar_declared_input():
    scalar = spec("s", "float32", [])
    check_declared(0, [t("float32")], [scalar])
    bad_input(0, [t("float32", 1)], [scalar])


def test_every_input_is_checked_not_just_the_first():
    error = bad_input([0, 1], [t("float32", 1, 4), t("int64", 3, 1)], [X, IDS])
    assert "'ids'" in error.message
