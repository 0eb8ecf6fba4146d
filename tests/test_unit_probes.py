"""Unit tests of supervisor/fleet/probes.py: the sentinel's verdicts and the decoding of probe outputs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import zmq

from modelwarden.shared.config import ProbeConfig
from modelwarden.shared.protocol import ProtocolError
from modelwarden.supervisor.fleet.probes import ProbeJudge, decode_outputs, load_golden


def judge(**config) -> ProbeJudge:
    return ProbeJudge(ProbeConfig(**config))


def f32(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_first_healthy_answer_is_recorded_as_golden():
    j = judge()
    out = f32(1.0, 2.0, 3.0)
    verdict = j.judge(["float32"], [out], latency_us=500, baseline_us=100)
    assert verdict.ok and verdict.reason == "recorded as golden" and verdict.drift == 0.0
    out[0] = 99.0  # the judge kept its own copy
    assert j.golden_of().arrays[0].tolist() == [1.0, 2.0, 3.0]
    assert j.golden_of().dtypes == ["float32"]
    again = j.judge(["float32"], [f32(1.0, 2.0, 3.0)], latency_us=100, baseline_us=100)
    assert again.ok and again.reason == "ok" and again.drift == 0.0


def test_unhealthy_first_answer_is_not_recorded():
    j = judge()
    verdict = j.judge(["float32"], [f32(1.0, np.nan)], 10, None)
    assert not verdict.ok and "NaN or Inf" in verdict.reason
    assert j.golden_of() is None
    assert j.judge(["float32"], [f32(1.0, 2.0)], 10, None).reason == "recorded as golden"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_outputs_fail(bad):
    j = judge(golden=None)
    j.judge(["float32", "float32"], [f32(0.0), f32(1.0, 2.0)], 10, None)
    verdict = j.judge(["float32", "float32"], [f32(0.0), f32(1.0, bad)], 10, None)
    assert not verdict.ok
    assert verdict.reason == "output 1 holds NaN or Inf"


def test_nonfinite_complex_fails():
    verdict = judge().judge(["complex64"], [np.array([1 + 1j, complex(0, np.inf)], np.complex64)], 1, None)
    assert not verdict.ok and "NaN or Inf" in verdict.reason


def test_integer_outputs_are_never_nonfinite():
    verdict = judge().judge(["int64"], [np.array([2**62, -(2**62)], np.int64)], 1, None)
    assert verdict.ok


def test_shape_mismatch_fails():
    j = ProbeJudge(ProbeConfig(), golden=[np.zeros((2, 3), np.float32)])
    verdict = j.judge(["float32"], [np.zeros((3, 2), np.float32)], 1, None)
    assert not verdict.ok and verdict.reason == "output 0: shape [3, 2], golden [2, 3]"


def test_output_count_mismatch_fails():
    j = judge()
    j.judge(["float32"], [f32(1.0)], 1, None)
    verdict = j.judge(["float32", "float32"], [f32(1.0), f32(1.0)], 1, None)
    assert not verdict.ok and verdict.reason == "2 outputs, golden has 1"
    assert not j.judge([], [], 1, None).ok


def test_dtype_mismatch_fails_even_when_values_agree():
    j = judge()
    j.judge(["float32"], [f32(1.0, 2.0)], 1, None)
    verdict = j.judge(["float64"], [np.array([1.0, 2.0])], 1, None)
    assert not verdict.ok and "dtypes" in verdict.reason and "float64" in verdict.reason


def test_range_check():
    j = judge(range=(0.0, 1.0))
    assert j.judge(["float32"], [f32(0.0, 0.5, 1.0)], 1, None).ok  # the bounds are inside
    low = j.judge(["float32"], [f32(0.0, -0.001)], 1, None)
    assert not low.ok and low.reason == "output 0 leaves the range [0.0, 1.0]"
    high = j.judge(["float32"], [f32(0.5, 1.001)], 1, None)
    assert not high.ok and "range" in high.reason


def test_range_check_applies_before_golden_is_recorded():
    j = judge(range=(-1.0, 1.0))
    assert not j.judge(["float32"], [f32(2.0)], 1, None).ok
    assert j.golden_of() is None


def test_empty_outputs_pass_the_range_check():
    j = judge(range=(0.0, 1.0))
    assert j.judge(["float32"], [np.zeros((0, 4), np.float32)], 1, None).ok


def test_drift_within_tolerance_passes_and_reports_max_abs_diff():
    j = judge(atol=0.01, rtol=0.0)
    j.judge(["float32"], [f32(1.0, 2.0)], 1, None)
    verdict = j.judge(["float32"], [f32(1.005, 2.0)], 1, None)
    assert verdict.ok and verdict.drift == pytest.approx(0.005, abs=1e-6)


def test_drift_beyond_atol_fails_and_reports_max_abs_diff():
    j = judge(atol=0.01, rtol=0.0)
    j.judge(["float32", "float32"], [f32(1.0, 2.0), f32(10.0)], 1, None)
    verdict = j.judge(["float32", "float32"], [f32(1.02, 2.0), f32(10.5)], 1, None)
    assert not verdict.ok
    assert verdict.drift == pytest.approx(0.5, abs=1e-6)  # the worst over all outputs
    assert "drifted" in verdict.reason and "0.5" in verdict.reason


def test_rtol_scales_with_the_golden_value():
    j = judge(atol=0.0, rtol=0.01)
    j.judge(["float32"], [f32(1000.0, 1.0)], 1, None)
    assert j.judge(["float32"], [f32(1009.0, 1.0)], 1, None).ok  # 9 <= 0.01 * 1000
    assert not j.judge(["float32"], [f32(1000.0, 1.02)], 1, None).ok  # 0.02 > 0.01 * 1
    assert not j.judge(["float32"], [f32(1011.0, 1.0)], 1, None).ok


def test_golden_from_file(tmp_path):
    np.savez(tmp_path / "golden.npz", out0=f32(1.0, 2.0), out1=np.arange(3, dtype=np.int64))
    golden = load_golden(tmp_path / "golden.npz")
    assert [g.tolist() for g in golden] == [[1.0, 2.0], [0, 1, 2]]
    j = ProbeJudge(ProbeConfig(), golden=golden)
    assert j.judge(["float32", "int64"], [f32(1.0, 2.0), np.arange(3)], 1, None).reason == "ok"
    verdict = j.judge(["float32", "int64"], [f32(1.0, 2.0), np.array([0, 1, 3])], 1, None)
    assert not verdict.ok and verdict.drift == 1.0
    np.save(tmp_path / "single.npy", f32(4.0))
    assert load_golden(tmp_path / "single.npy")[0].tolist() == [4.0]


def test_latency_limit_is_the_factor_when_that_is_larger():
    # factor 10 x 50 ms = 500 ms beats 50 ms + 100 ms slack
    j = judge(latency_factor=10.0, latency_slack_ms=100.0)
    j.judge(["float32"], [f32(1.0)], 1, None)
    assert j.judge(["float32"], [f32(1.0)], 500_000, 50_000).ok
    verdict = j.judge(["float32"], [f32(1.0)], 500_001, 50_000)
    assert not verdict.ok and verdict.reason == "probe took 500001 us, baseline 50000 us"
    assert verdict.drift == 0.0


def test_latency_limit_is_baseline_plus_slack_when_that_is_larger():
    # 1 ms baseline: 10x is 10 ms, but baseline + 100 ms slack = 101 ms wins (no flapping)
    j = judge(latency_factor=10.0, latency_slack_ms=100.0)
    j.judge(["float32"], [f32(1.0)], 1, None)
    assert j.judge(["float32"], [f32(1.0)], 101_000, 1_000).ok
    assert j.judge(["float32"], [f32(1.0)], 50_000, 1_000).ok
    assert not j.judge(["float32"], [f32(1.0)], 101_001, 1_000).ok


def test_latency_is_not_checked_without_a_baseline():
    j = judge(latency_factor=2.0, latency_slack_ms=0.0)
    j.judge(["float32"], [f32(1.0)], 1, None)
    assert j.judge(["float32"], [f32(1.0)], 10**9, None).ok


def test_drift_is_reported_before_latency():
    j = judge(atol=0.0, rtol=0.0, latency_factor=2.0, latency_slack_ms=0.0)
    j.judge(["float32"], [f32(1.0)], 1, None)
    verdict = j.judge(["float32"], [f32(2.0)], 10**9, 1)
    assert not verdict.ok and "drifted" in verdict.reason


def test_complex_drift_in_the_imaginary_part_fails():
    j = judge(atol=1e-3, rtol=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        j.judge(["complex64"], [np.array([1 + 1j], np.complex64)], 1, None)
        verdict = j.judge(["complex64"], [np.array([1 + 5j], np.complex64)], 1, None)
    assert not verdict.ok


# -- decode_outputs -----------------------------------------------------------------------------


def bf16_bytes(values) -> bytes:
    """bfloat16 is the upper half of a float32 (truncated), little-endian."""
    upper = (np.array(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return upper.astype("<u2").tobytes()


def test_decode_bfloat16_widens_to_float32():
    frames = [zmq.Frame(bf16_bytes([1.0, -2.5, 0.0, 3.0e38, 0.15625, -0.0]))]
    (out,) = decode_outputs([{"dtype": "bfloat16", "shape": [2, 3], "frame": 0}], frames)
    assert out.dtype == np.float32 and out.shape == (2, 3)
    expected = np.array([1.0, -2.5, 0.0, 2.99e38, 0.15625, -0.0], np.float32)
    assert np.allclose(out.ravel(), expected, rtol=0.01)
    assert out.ravel()[:3].tolist() == [1.0, -2.5, 0.0]
    assert np.signbit(out.ravel()[5])


def test_decode_bfloat16_nan_and_inf_are_caught_by_the_judge():
    frames = [zmq.Frame(bf16_bytes([np.inf, 1.0]))]
    outputs = decode_outputs([{"dtype": "bfloat16", "shape": [2], "frame": 0}], frames)
    assert np.isinf(outputs[0][0])
    assert not judge().judge(["bfloat16"], outputs, 1, None).ok


def test_decode_bool():
    frames = [zmq.Frame(b"\x01\x00\x01\x01")]
    (out,) = decode_outputs([{"dtype": "bool", "shape": [2, 2], "frame": 0}], frames)
    assert out.dtype == np.bool_
    assert out.tolist() == [[True, False], [True, True]]


def test_decode_several_frames_by_index_and_scalars():
    floats = np.array([[1.5, -2.0]], np.float64).tobytes()
    ints = np.array(7, np.int32).tobytes()
    frames = [zmq.Frame(floats), zmq.Frame(ints)]
    descs = [{"dtype": "float64", "shape": [1, 2], "frame": 0}, {"dtype": "int32", "shape": [], "frame": 1}]
    a, b = decode_outputs(descs, frames)
    assert a.dtype == np.float64 and a.tolist() == [[1.5, -2.0]]
    assert b.dtype == np.int32 and b.shape == () and int(b) == 7


def test_decode_empty_tensor():
    (out,) = decode_outputs([{"dtype": "float32", "shape": [0, 3], "frame": 0}], [zmq.Frame(b"")])
    assert out.shape == (0, 3) and out.dtype == np.float32


def test_decoded_outputs_judge_against_recorded_golden():
    def run(values):
        frames = [zmq.Frame(bf16_bytes(values)), zmq.Frame(b"\x00\x01")]
        descs = [{"dtype": "bfloat16", "shape": [len(values)], "frame": 0},
                 {"dtype": "bool", "shape": [2], "frame": 1}]
        return decode_outputs(descs, frames)

    j = judge(atol=0.0, rtol=0.0)
    assert j.judge(["bfloat16", "bool"], run([1.0, 2.0]), 1, None).reason == "recorded as golden"
    assert j.judge(["bfloat16", "bool"], run([1.0, 2.0]), 1, None).ok
    verdict = j.judge(["bfloat16", "bool"], run([1.0, 2.5]), 1, None)
    assert not verdict.ok and verdict.drift == 0.5


@pytest.mark.parametrize("descs, frames", [
    ([{"dtype": "float32", "shape": [1], "shm": ["0123456789abcdef" * 2, 0, 4]}], []),  # not inline
    ([{"dtype": "float32", "shape": [2], "frame": 0}], [zmq.Frame(b"\x00" * 4)]),  # short frame
    ([{"dtype": "float32", "shape": [1], "frame": 1}], [zmq.Frame(b"\x00" * 4)]),  # no frame 1
    ([{"dtype": "float32", "frame": 0}], [zmq.Frame(b"\x00" * 4)]),  # no shape
])
def test_decode_refuses_a_malformed_probe_answer(descs, frames):
    from modelwarden.shared.protocol import INTERNAL, ProtocolError

    with pytest.raises(ProtocolError) as info:
        decode_outputs(descs, frames)
    assert info.value.code == INTERNAL


def test_each_version_records_its_own_golden_and_is_judged_by_it():
    j = judge()
    assert j.judge(["float32"], [f32(1.0, 2.0)], 1, None, version="v1").reason == "recorded as golden"
    # Version 2 computes something else: it records its own golden, it does not fail against v1's.
    assert j.judge(["float32"], [f32(2.0, 4.0)], 1, None, version="v2").reason == "recorded as golden"
    assert j.judge(["float32"], [f32(2.0, 4.0)], 1, None, version="v2").ok
    assert j.judge(["float32"], [f32(1.0, 2.0)], 1, None, version="v1").ok
    assert not j.judge(["float32"], [f32(1.0, 2.0)], 1, None, version="v2").ok
    assert sorted(j.recorded) == ["v1", "v2"]


def test_a_golden_file_holds_every_version_and_a_reload_keeps_recorded_goldens():
    j = ProbeJudge(ProbeConfig(), golden=[f32(1.0)])
    assert not j.judge(["float32"], [f32(3.0)], 1, None, version="new").ok  # never recorded
    plain = judge()
    plain.judge(["float32"], [f32(1.0)], 1, None, version="v1")
    looser = plain.reconfigured(ProbeConfig(atol=1.0), None)
    assert looser.judge(["float32"], [f32(1.5)], 1, None, version="v1").ok
    assert looser.golden_of("v1").arrays[0].tolist() == [1.0]


def test_str_outputs_are_judged_by_their_payload():
    def answer(*texts: bytes):
        payload = b"".join(len(text).to_bytes(4, "little") + text for text in texts)
        desc = {"dtype": "str", "shape": [len(texts)], "nbytes": len(payload),
                "longest": max(map(len, texts)), "frame": 0}
        return decode_outputs([desc], [zmq.Frame(payload)])

    checker = judge()
    assert checker.judge(["str"], answer(b"AB", b"C"), 1, None).ok  # recorded as golden
    assert checker.judge(["str"], answer(b"AB", b"C"), 1, None).ok
    assert not checker.judge(["str"], answer(b"AB", b"D"), 1, None).ok  # a byte: drift
    assert not checker.judge(["str"], answer(b"ABC", b"D"), 1, None).ok  # a length: shape
    with pytest.raises(ProtocolError, match="malformed reply: .*not valid UTF-8") as raised:
        answer(b"\xff")  # checked as the client would; a worker's bug, so INTERNAL
    assert raised.value.code == "INTERNAL"
