"""Sentinel probes, from due time to verdict: when a worker's probe is due, what is sent, and the
judgement: is this worker's answer to the known input still the known output?

``ProbeRecord`` is one worker's probe state (due, in flight, timed out, last verdict);
``RUN_PROBE`` the message; ``verdict_of`` reads the answer; ``ProbeJudge`` judges it and
``judge_for``/``judges_for_reload`` build one per model. What follows a verdict (a replacement
after ``probe.failures`` in a row, FATAL after ``max_replacements``) is the pool's policy
(supervisor/fleet/pool.py); the router only carries the message and the answer.

Checks, in order: NaN/Inf; the optional value range; count, shape and dtype of the outputs;
``|out - golden| <= atol + rtol * |golden|`` everywhere; and latency within ``latency_factor``
times the worker's own healthy baseline (and at least ``latency_slack_ms`` above it, so a busy
2-core box does not flap). The golden output is a file (``probe.golden``), or else the first
healthy answer after warm-up *of each model version* (supervisor/fleet/versions.py): a worker of a new
version is never judged against the output of the old one, and the first worker of the new
version records its own. A prepared model (``[models.prepare]``, worker/prepare.py) is judged by
the FP32 answers it was held to before READY: its worker sends them in its READY info
(``reference``) and they become the version's golden, and its tolerance is the wider of the
probe's and the prepare step's (``probe_config_of``). This module needs numpy only: the
supervisor never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from modelwarden.shared import protocol
from modelwarden.shared.config import ModelConfig, ProbeConfig, Settings
from modelwarden.shared.descriptors import (decode_elements, malformed, parse_reply,
                                            parse_reply_tensors)
from modelwarden.shared.protocol import BAD_REQUEST, DTYPES, ProtocolError, TensorDesc

if TYPE_CHECKING:
    from modelwarden.supervisor.fleet.reload import ReloadPlan

_NUMPY = {name: np.dtype(name) for name in DTYPES if name != "bfloat16"}


@dataclass(eq=False, slots=True)
class ProbeRecord:
    """What the sentinel last learnt about one worker."""

    due_at: float = 0.0
    inflight_since: float | None = None
    rid: int | None = None  # the probe in flight; a late answer to an older one is ignored
    ahead: int = 0  # requests the worker got before the probe in flight and has not answered
    unanswered: bool = False  # a probe timed out: the worker is stuck, replace it
    last_at: float | None = None  # wall-clock time of the last verdict
    last_ok: bool | None = None
    last_reason: str = ""
    consecutive_failures: int = 0
    failures: int = 0  # every failed probe of this worker (metrics: modelwarden_probe_failures)
    drift: float | None = None
    latency_us: int | None = None
    baseline_us: int | None = None
    cuda_bytes: int | None = None  # CUDA memory the worker held right after its last probe

    def sent(self, rid: int, now: float, ahead: int = 0) -> None:
        """``ahead``: the requests the worker holds already (max_inflight > 1). It serves what
        it holds one at a time, in the order sent, so the probe's timeout counts from the
        answer to the last of them, not through their forwards."""
        self.rid, self.inflight_since, self.ahead = rid, now, ahead

    def answered_ahead(self, now: float) -> None:
        """The worker answered a request (not a probe). While a probe is in flight behind
        requests, this is one of them: the last one starts the probe's clock."""
        if self.ahead:
            self.ahead -= 1
            self.inflight_since = now

    def settle(self) -> None:
        """No probe is in flight any more: answered, timed out, or its worker gone."""
        self.rid = self.inflight_since = None
        self.ahead = 0


    def timed_out(self, now: float, timeout: float) -> bool:
        """The probe in flight has waited longer than ``timeout``: settled, and marked
        unanswered (the worker still holds it, so no later probe can reach it)."""
        if self.inflight_since is None or self.ahead or now - self.inflight_since <= timeout:
            return False
        self.settle()
        self.unanswered = True
        return True


def run_probe(rid: int) -> bytes:
    """The probe's RUN message: the worker runs its own known input (no payload travels)."""
    return protocol.pack({"type": protocol.RUN, "rid": rid, "probe": True})


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
    """Checked inline outputs as float-comparable numpy arrays; bfloat16 widened. A str/bytes
    output is checked (``decode_elements``) and judged by its payload's bytes: any change of an
    element changes them (its length, the shape; a byte, the drift)."""
    arrays = []
    for desc in tensors:
        frame = frames[desc.frame]
        raw = np.frombuffer(getattr(frame, "buffer", frame), dtype=np.uint8)
        if desc.longest is not None:
            try:
                decode_elements(raw, desc)
            except ProtocolError as exc:  # the worker's bug, as any malformed answer
                raise malformed(exc.message) from None
            arrays.append(raw)
        elif desc.dtype == "bfloat16":
            widened = raw.view(np.uint16).astype(np.uint32) << 16
            arrays.append(widened.view(np.float32).reshape(desc.shape))
        else:
            arrays.append(raw.view(_NUMPY[desc.dtype]).reshape(desc.shape))
    return arrays


def reference_arrays(entries: object) -> list[np.ndarray] | None:
    """``[{"dtype", "shape", "data"}]`` from a worker's READY info as arrays; None if malformed
    (a worker's report is checked like any wire input, never asserted)."""
    if not isinstance(entries, list) or not entries:
        return None
    arrays = []
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            return None
        shape, data = entry.get("shape"), entry.get("data")
        if (not isinstance(shape, list) or not all(isinstance(dim, int) and dim >= 0 for dim in shape)
                or not isinstance(data, bytes)):
            return None
        itemsize = 2 if entry["dtype"] == "bfloat16" else _NUMPY[entry["dtype"]].itemsize
        if len(data) != itemsize * int(np.prod(shape, dtype=np.int64)):
            return None
        arrays.append(probe_arrays([TensorDesc(entry["dtype"], tuple(shape), len(data), 0)], [data])[0])
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

    def adopt_reference(self, version: str, entries: object) -> bool:
        """A prepared worker's FP32 answers become ``version``'s golden when it has none yet
        (a golden file always wins); False when there was nothing to adopt."""
        if self.golden_of(version) is not None:
            return False
        arrays = reference_arrays(entries)
        if arrays is None:
            return False
        self.recorded[version] = Golden(arrays)  # dtypes unchecked, as for a golden file
        return True

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


# -- the answer -----------------------------------------------------------------------------------


def verdict_of(record: ProbeRecord, rid: int, envelope: dict, header: bytes | memoryview,
               frames: list, judge: ProbeJudge, version: str) -> "Verdict | None":
    """The verdict on the worker's answer to probe ``rid``; None for a late answer (its probe
    already timed out and counted as a failure). A worker answering garbage fails its probe."""
    if record.rid != rid:
        return None
    record.settle()
    try:
        reply = parse_reply(protocol.unpack_header(header, strict=False), frames, shm=False)
        if not reply.ok:
            return Verdict(False, f"probe raised {reply.error.code}: {reply.error.message}")
        outputs = probe_arrays(reply.tensors, frames)
        record.latency_us = envelope.get("compute_us")
        record.cuda_bytes = envelope.get("cuda_bytes")
        return judge.judge([desc.dtype for desc in reply.tensors], outputs,
                           record.latency_us or 0, record.baseline_us, version)
    except Exception as exc:
        return Verdict(False, f"probe answer unreadable: {exc}")


# -- judges, per model ----------------------------------------------------------------------------


def probe_config_of(model: ModelConfig) -> ProbeConfig:
    """The probe settings a model is judged by: a prepared model's answers may differ from its
    FP32 golden by as much as its prepare hold allowed, so the wider tolerance applies."""
    if not model.prepare.steps:
        return model.probe
    return model.probe.model_copy(update={"atol": max(model.probe.atol, model.prepare.atol),
                                          "rtol": max(model.probe.rtol, model.prepare.rtol)})


def judge_for(model: ModelConfig, settings: Settings) -> ProbeJudge:
    golden = model.probe.golden
    return ProbeJudge(probe_config_of(model), load_golden(settings.resolve(golden)) if golden else None)


def judges_for_reload(new: Settings, changes: "ReloadPlan", judges: dict[str, ProbeJudge],
                      probe_configs: dict[str, ProbeConfig]) -> dict[str, ProbeJudge]:
    """Each added or kept model's judge under ``new``: the running one (``judges``, whose
    configs are ``probe_configs``) where its probe settings did not change. A golden file that
    cannot be read refuses the reload (``check_files`` saw it exists, not that it parses):
    ProtocolError, with nothing touched."""
    result = {}
    for config in [*changes.added, *(change.config for change in changes.kept.values())]:
        running = judges.get(config.name)
        probe = probe_config_of(config)
        if running is not None and probe_configs[config.name] == probe:
            result[config.name] = running
            continue
        try:
            golden = load_golden(new.resolve(config.probe.golden)) if config.probe.golden else None
        except (OSError, ValueError) as exc:
            raise ProtocolError(BAD_REQUEST, f"config error: {config.name}.probe.golden: "
                                f"{exc}; the running configuration is unchanged") from None
        result[config.name] = (ProbeJudge(probe, golden) if running is None
                               else running.reconfigured(probe, golden))
    return result
