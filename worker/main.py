"""Entry point of a worker process (the target of a multiprocessing *spawn* Process).

Boot order, each step reported to the supervisor before the next:
  0. ``sys.path`` becomes exactly ``spec.python_path``: the configured ``python_path`` and the
     interpreter's own paths, never the supervisor's working directory (shared/syspath.py)
  1. die with the parent; ignore SIGINT (the supervisor decides when we stop)
  2. pin to our cores and set OMP/MKL thread variables -- before torch is imported
  3. import torch; set thread counts; pick the device           (failure: exit 3, boot error)
  4. LOADING: load our own copy of the model                    (failure: exit 4, load error)
     then, with ``[models.prepare]`` steps, prepare it and hold it to the answers of the model
     as loaded on the probe input (worker/prepare.py)          (failure: exit 7, prepare error)
  5. WARMING: run ``warmup`` iterations, measure the probe baseline (failure: exit 5)
  6. READY: serve until told to stop (exit 0) or orphaned (exit 6)
     A standby (``spec.standby`` set) reports STANDBY instead and waits to be promoted into a
     slot (worker/standby.py), then reports READY and serves. It boots at a lower CPU priority
     (set after step 2, before any thread exists) when it may restore it on promotion.

This module must not import torch at module level: spawn imports it in the child before ``run``
gets a chance to pin the process and set the thread variables.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import multiprocessing
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any


from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.logs import setup_logging
from modelwarden.shared.states import (EXIT_BOOT_ERROR, EXIT_LOAD_ERROR, EXIT_ORPHANED,
                                       EXIT_PREPARE_ERROR, EXIT_WARMUP_ERROR, WorkerState)
from modelwarden.shared.process import die_with_parent
from modelwarden.worker.pinning import PlacementError, pin_cpu

logger = logging.getLogger(__name__)
BASELINE_RUNS = 5
# The FP32 answers a prepared model was held to go to the supervisor as the probe's golden when
# no golden file is configured, so the sentinel judges by the same answers; a larger output is
# left to the first healthy probe answer (the supervisor records it, as for any model).
MAX_REFERENCE_BYTES = 1024 * 1024


def run(spec: WorkerSpec, buffer_pair=None, link_socket=None) -> None:
    """``buffer_pair``: our end of the socket pair the supervisor passes buffer descriptors on;
    ``link_socket``: our end of the worker link (shared/link.py), every other message."""
    # Spawn gave us the supervisor's sys.path, whose first entry may be its working directory:
    # from here on, only what the supervisor chose (shared/syspath.py) is searched.
    sys.path[:] = spec.python_path
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not die_with_parent(spec.supervisor_pid):
        sys.exit(EXIT_ORPHANED)
    faulthandler.enable()
    setup_logging(spec.worker_id, spec.log_level, spec.log_format)
    _set_title(spec)
    boot_error = None
    try:
        pin_cpu(spec)
    except PlacementError as exc:
        boot_error = str(exc)
    if spec.standby is not None:
        from modelwarden.worker.standby import boot_in_the_background

        boot_in_the_background()  # before any thread exists: every thread inherits it
    link = _connect(spec, link_socket)
    if boot_error is not None:
        _fail(link, "boot", boot_error, EXIT_BOOT_ERROR)
    sys.exit(_boot_and_serve(spec, link, buffer_pair))


def _set_title(spec: WorkerSpec) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(f"modelwarden: worker {spec.worker_id} {spec.placement}")
    except ImportError:
        pass


def _connect(spec: WorkerSpec, link_socket):
    from modelwarden.shared.link import Link
    from modelwarden.worker.serve import SupervisorLink  # imports torch: only after pinning

    link = SupervisorLink(Link(link_socket, writable=True))
    link.hello(spec.secret)
    spec.secret = b""  # sent; the model's code has no business with it
    return link


def _fail(link, stage: str, message: str, code: int) -> None:
    logger.error("%s failed: %s", stage, message)
    link.failed(stage, message)  # written whole (a blocking send): it reaches the supervisor
    link.close()
    sys.exit(code)


def _boot_and_serve(spec: WorkerSpec, link, buffer_pair) -> int:
    import torch

    from modelwarden.worker.loader import LoadError, example_value, load_model, probe_value
    from modelwarden.worker.pinning import configure_torch
    from modelwarden.worker.pipeline import Pipeline
    from modelwarden.worker.serve import WorkerServer

    try:
        device = configure_torch(spec)
    except Exception as exc:  # an absent device, a CUDA error: the worker cannot be placed
        _fail(link, "boot", f"{type(exc).__name__}: {exc}" if not isinstance(exc, PlacementError)
              else str(exc), EXIT_BOOT_ERROR)
    link.state(WorkerState.LOADING.value, pid=os.getpid(), device=str(device),
                  cores=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
                  interop_threads=torch.get_num_interop_threads())
    try:
        model = load_model(spec, device)
    except LoadError as exc:
        _fail(link, "load", str(exc), EXIT_LOAD_ERROR)
    pipeline = Pipeline(model, spec.model.batching)
    prepared: dict = {}
    if spec.model.prepare.steps:
        prepared = _prepare_and_hold(spec, pipeline, device, link, probe_value)
    link.state(WorkerState.WARMING.value)
    try:
        warmed, last_outputs = _warm_up(spec, pipeline, device, example_value)
        probe = probe_value(spec, device) if spec.model.probes_enabled else None
        baseline_us = _baseline(pipeline, probe, device) if probe is not None else None
    except Exception as exc:
        _fail(link, "warmup", f"{type(exc).__name__}: {exc}", EXIT_WARMUP_ERROR)
    parent = multiprocessing.parent_process()
    if spec.standby is not None:
        code = _stand_by(spec, link, parent, baseline_us)
        if code is not None:
            return code
    link.state(WorkerState.READY.value, threads=torch.get_num_threads(),
                  interop_threads=torch.get_num_interop_threads(),
                  cores=sorted(os.sched_getaffinity(0)), device=str(device),
                  probe_baseline_us=baseline_us, warmup=warmed,
                  outputs=_outputs_of(spec, last_outputs), **prepared)
    logger.info("READY on %s with %d thread(s) after %s", spec.placement,
                torch.get_num_threads(), _warmed_words(warmed))
    gc.freeze()  # the model and torch's own objects live forever: don't rescan them every pass
    server = WorkerServer(spec, pipeline, device, link, parent.sentinel if parent else None,
                          probe, buffer_pair)
    return server.serve()


def _stand_by(spec: WorkerSpec, link, parent, baseline_us) -> int | None:
    """Report STANDBY and wait; None once promoted (``spec`` is the slot's now), else the
    exit code."""
    import torch

    from modelwarden.worker.standby import wait_for_promotion

    link.state(WorkerState.STANDBY.value, threads=torch.get_num_threads(),
                  cores=sorted(os.sched_getaffinity(0)), probe_baseline_us=baseline_us)
    logger.info("STANDBY on %s with %d thread(s)", spec.placement, torch.get_num_threads())
    gc.freeze()
    return wait_for_promotion(spec, link, parent.sentinel if parent else None)


def _warm_up(spec: WorkerSpec, pipeline, device, example_value) -> tuple[dict, Any]:
    """Run every operator once before traffic, at the shapes traffic will have (thread pools,
    allocator caches, kernel choices): with batching or buckets, every bucket at batch size 1
    and at ``max_size`` (Triton's model_warmup), ``warmup`` forwards shared among them (at least
    one each). Returns the forwards run per bucket and batch size, for status and the log, and
    the last forward's answer (after postprocess; None with no warm-up): what the outputs are
    learned from."""
    import torch

    from modelwarden.shared.codec import unflatten

    if not spec.model.warmup:
        return {}, None
    template = pipeline.member(example_value(spec, device))
    batching = spec.model.batching
    if batching.enabled or batching.bucketed:
        shapes = pipeline.warm_up_shapes()
    else:  # one request at a time: the example's own shape is the shape traffic has
        shapes = [("any", template.rows, None)]
    each = max(1, spec.model.warmup // len(shapes))
    counts: dict = {}
    with torch.inference_mode():
        for label, rows, length in shapes:
            member = pipeline.shaped(template, rows, length) if rows != template.rows or length \
                else template
            for _ in range(each):
                results, _ = pipeline.run([member])
                _raise_failed(results)
            counts.setdefault(label, {})[str(rows)] = each
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return counts, unflatten(results[0].tree, results[0].leaves)


def _outputs_of(spec: WorkerSpec, outputs) -> list[dict] | None:
    """The READY info's ``outputs``: learned from a warm-up forward (worker/outputs.py)."""
    from modelwarden.worker.outputs import learned_outputs

    if outputs is None:
        return None
    learned = learned_outputs(outputs, _batch_dim(spec))
    batching = spec.model.batching
    if batching.bucketed:  # these keep each member's own length: it varies as the batch does
        for output in learned:
            if output["name"] in batching.keep_length and len(output["shape"]) > batching.length_dim:
                output["shape"][batching.length_dim] = -1
    return learned


def _batch_dim(spec: WorkerSpec) -> int | None:
    """The dimension that varies from request to request: the batching one, when the model
    batches or its declared inputs leave that dimension open."""
    dim = spec.model.batching.dim
    open_inputs = any(len(item.shape) > dim and item.shape[dim] == -1 for item in spec.model.inputs or [])
    return dim if spec.model.batching.enabled or open_inputs else None


def _prepare_and_hold(spec: WorkerSpec, pipeline, device, link, probe_value) -> dict:
    """The pipeline's model prepared (a handler's ``model``), and the READY info saying how --
    or the worker fails at stage "prepare": a step that cannot be applied or run, or answers
    past ``atol``/``rtol`` of the FP32 ones on the probe's request, through the whole pipeline
    (the configured golden file, when there is one; else the model as loaded)."""
    from modelwarden.worker.prepare import PrepareError, hold_to_reference, prepare

    config = spec.model.prepare
    try:
        member = pipeline.member(probe_value(spec, device))
        reference = _reference_outputs(spec, pipeline, member)
        pipeline.replace_model(prepare(pipeline.inner_model, config, device))
        outputs = _first_call(pipeline, member, config.steps)
    except PrepareError as exc:
        _fail(link, "prepare", str(exc), EXIT_PREPARE_ERROR)
    except Exception as exc:  # the probe input or the FP32 answers could not be made
        _fail(link, "prepare", f"the FP32 reference: {type(exc).__name__}: {exc}", EXIT_PREPARE_ERROR)
    ok, difference = hold_to_reference(reference, outputs, config.atol, config.rtol)
    steps = ", ".join(config.steps)
    if not ok:
        _fail(link, "prepare", f"{steps}: max |prepared - fp32| = {difference:.6g} on the probe "
              f"input, past atol {config.atol:g} + rtol {config.rtol:g} x |fp32|; not going READY",
              EXIT_PREPARE_ERROR)
    logger.info("prepared (%s): max |prepared - fp32| = %.6g", steps, difference)
    info: dict = {"prepare": {"steps": config.steps, "max_abs_diff": difference,
                              "atol": config.atol, "rtol": config.rtol}}
    if spec.model.probe.golden is None:
        info["reference"] = _reference_payload(reference)
    return info


def _reference_outputs(spec: WorkerSpec, pipeline, member):
    """The FP32 answers: the configured golden file, else the model as loaded, run now (before
    a cast changes its weights in place)."""
    from modelwarden.worker.loader import load_tensor_file
    from modelwarden.worker.prepare import output_leaves

    if spec.model.probe.golden is not None:
        return load_tensor_file(Path(spec.base_dir) / Path(spec.model.probe.golden).expanduser())
    return [leaf.detach().cpu().clone() for leaf in output_leaves(_answer(pipeline, member))]


def _answer(pipeline, member):
    """The pipeline's whole answer to one member (after postprocess), under inference mode."""
    import torch

    with torch.inference_mode():
        results, _ = pipeline.run([member])
    _raise_failed(results)
    return results[0].leaves


def _first_call(pipeline, member, steps: list[str]):
    """The prepared model's answer to the probe input. torch.compile compiles here, so its
    failures are named as the compile step's (the last step is the one a first call runs)."""
    from modelwarden.worker.prepare import PrepareError

    try:
        return _answer(pipeline, member)
    except Exception as exc:
        raise PrepareError(f"{steps[-1]}: the first call failed: {type(exc).__name__}: {exc}") from exc


def _reference_payload(reference: list) -> list[dict] | None:
    """The FP32 answers as the supervisor reads a golden (dtype, shape, raw bytes), or None
    when they are larger than MAX_REFERENCE_BYTES."""
    import torch

    from modelwarden.shared.codec import DTYPE_NAMES

    if sum(leaf.numel() * leaf.element_size() for leaf in reference) > MAX_REFERENCE_BYTES:
        return None
    return [{"dtype": DTYPE_NAMES[leaf.dtype], "shape": list(leaf.shape),
             "data": leaf.contiguous().view(-1).view(torch.uint8).numpy().tobytes()}
            for leaf in reference]


def _raise_failed(results: list) -> None:
    """A warm-up postprocess that raised fails the boot, as a forward that raised does."""
    for result in results:
        if isinstance(result, Exception):
            raise result


def _warmed_words(counts: dict) -> str:
    total = sum(n for sizes in counts.values() for n in sizes.values())
    if not counts:
        return "no warm-up"
    shapes = ", ".join(f"{label}x{size}" for label, sizes in counts.items() for size in sizes)
    return f"{total} warm-up forward(s) ({shapes})"


def _baseline(pipeline, probe, device) -> int:
    """This worker's own probe latency when healthy: later probes are judged against it (the
    forward's time, as a probe's answer reports it)."""
    import torch

    timings = []
    with torch.inference_mode():
        member = pipeline.member(probe)
        for _ in range(BASELINE_RUNS):
            results, compute_us = pipeline.run([member])
            _raise_failed(results)
            if device.type == "cuda":
                started = time.perf_counter_ns()
                torch.cuda.synchronize(device)
                compute_us += (time.perf_counter_ns() - started) // 1000
            timings.append(compute_us)
    return int(statistics.median(timings))
