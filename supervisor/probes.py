"""The sentinel's judgement: is this worker's answer to the known input still the known output?

Checks, in order: NaN/Inf; the optional value range; count, shape and dtype of the outputs;
``|out - golden| <= atol + rtol * |golden|`` everywhere; and latency within ``latency_factor``
times the worker's own healthy baseline (and at least ``latency_slack_ms`` above it, so a busy
2-core box does not flap). The golden output is a file (``probe.golden``), or else the first
healthy answer after warm-up *of each model version* (supervisor/versions.py): a worker of a new
version is never judged against the output of the old one, and the first worker of the new
version records its own. This module needs numpy only: the supervisor never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modelwarden.shared.config import ProbeConfig
from modelwarden.shared.descriptors import parse_reply_tensors
from modelwarden.shared.protocol import DTYPES, TensorDesc

_NUMPY = {name: np.dtype(name) for name in DTYPES if name != "bfloat16"}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    drift: float | None = None


def decode_outputs(descs: list, frames: list) -> list[np.ndarray]:
    """A probe's output descriptors, as the worker sent them, checked (always inline: a
    shared-memory one is refused) and decoded; ProtocolError(INTERNAL) if malformed."""
    return probe_arrays(parse_reply_tensors(descs, frames, shm=False), frames)


def probe_arrays(tensors: list[TensorDesc], frames: list) -> list[np.ndarray]:
    """Checked inline outputs as float-comparable numpy arrays; bfloat16 widened."""
    arrays = []
    for desc in tensors:
        frame = frames[desc.frame]
        raw = np.frombuffer(getattr(frame, "buffer", frame), dtype=np.uint8)
        if desc.dtype == "bfloat16":
            widened = raw.view(np.uint16).astype(np.uint32) << 16
            arrays.append(widened.view(np.float32).reshape(desc.shape))
        else:
            arrays.append(raw.view(_NUMPY[desc.dtype]).reshape(desc.shape))
    return arrays


def load_golden(path: Path) -> list[np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return [archive[key] for key in archive.files]
    return [np.load(path, allow_pickle=False)]


class Golden:
    """One version's reference output (dtypes known only when recorded from a worker)."""

    def __init__(self, arrays: list[np.ndarray], dtypes: list[str] | None = None) -> None:
        self.arrays = arrays
        self.dtypes = dtypes


class ProbeJudge:
    """``golden``: the configured file's arrays, which every version is held to; without one,
    each version's golden is recorded from its first healthy answer (``recorded``)."""

    def __init__(self, config: ProbeConfig, golden: list[np.ndarray] | None = None) -> None:
        self.config = config
        self.file_golden = Golden(golden) if golden is not None else None
        self.recorded: dict[str, Golden] = {}

    def golden_of(self, version: str = "") -> Golden | None:
        return self.file_golden or self.recorded.get(version)

    def reconfigured(self, config: ProbeConfig, golden: list[np.ndarray] | None) -> "ProbeJudge":
        """The judge under a reloaded probe configuration: recorded goldens stay with their
        versions (a tolerance change does not make an output wrong)."""
        judge = ProbeJudge(config, golden)
        judge.recorded = self.recorded
        return judge

    def judge(self, dtypes: list[str], outputs: list[np.ndarray], latency_us: int,
              baseline_us: int | None, version: str = "") -> Verdict:
        problem = _nonfinite(outputs) or self._out_of_range(outputs)
        if problem:
            return Verdict(False, problem)
        golden = self.golden_of(version)
        if golden is None:
            self.recorded[version] = Golden([np.array(array, copy=True) for array in outputs],
                                            list(dtypes))
            return Verdict(True, "recorded as golden", 0.0)
        problem = _mismatch(golden, dtypes, outputs)
        if problem:
            return Verdict(False, problem)
        drift = self._drift(golden.arrays, outputs)
        if drift is not None:
            return Verdict(False, f"drifted from golden by {drift:.3g}", drift)
        if baseline_us is not None and self._too_slow(latency_us, baseline_us):
            return Verdict(False, f"probe took {latency_us} us, baseline {baseline_us} us",
                           _max_abs(golden.arrays, outputs))
        return Verdict(True, "ok", _max_abs(golden.arrays, outputs))

    def _out_of_range(self, outputs: list[np.ndarray]) -> str | None:
        if self.config.range is None:
            return None
        low, high = self.config.range
        for index, array in enumerate(outputs):
            if array.size and (array.min() < low or array.max() > high):
                return f"output {index} leaves the range [{low}, {high}]"
        return None

    def _drift(self, golden: list[np.ndarray], outputs: list[np.ndarray]) -> float | None:
        """The largest absolute difference, if any element is outside the tolerance."""
        for array, reference in zip(outputs, golden):
            a, g = _widen(array), _widen(reference)
            if not np.all(np.abs(a - g) <= self.config.atol + self.config.rtol * np.abs(g)):
                return _max_abs(golden, outputs)
        return None

    def _too_slow(self, latency_us: int, baseline_us: int) -> bool:
        limit = max(self.config.latency_factor * baseline_us,
                    baseline_us + self.config.latency_slack_ms * 1000)
        return latency_us > limit


def _mismatch(golden: Golden, dtypes: list[str], outputs: list[np.ndarray]) -> str | None:
    if len(outputs) != len(golden.arrays):
        return f"{len(outputs)} outputs, golden has {len(golden.arrays)}"
    for index, (array, reference) in enumerate(zip(outputs, golden.arrays)):
        if array.shape != reference.shape:
            return f"output {index}: shape {list(array.shape)}, golden {list(reference.shape)}"
    if golden.dtypes is not None and dtypes != golden.dtypes:
        return f"output dtypes {dtypes}, golden {golden.dtypes}"
    return None


def _max_abs(golden: list[np.ndarray], outputs: list[np.ndarray]) -> float:
    worst = 0.0
    for array, reference in zip(outputs, golden):
        if array.size:
            worst = max(worst, float(np.abs(_widen(array) - _widen(reference)).max()))
    return worst


def _widen(array: np.ndarray) -> np.ndarray:
    """float64, or complex128 for complex outputs (a cast to float64 would drop the imaginary
    part, and with it any drift there)."""
    return array.astype(np.complex128 if array.dtype.kind == "c" else np.float64)


def _nonfinite(outputs: list[np.ndarray]) -> str | None:
    for index, array in enumerate(outputs):
        if array.dtype.kind in "fc" and array.size and not np.isfinite(array).all():
            return f"output {index} holds NaN or Inf"
    return None
