"""Entry point of a worker process (the target of a multiprocessing *spawn* Process).

Boot order, each step reported to the supervisor before the next:
  0. ``sys.path`` becomes exactly ``spec.python_path``: the configured ``python_path`` and the
     interpreter's own paths, never the supervisor's working directory (shared/syspath.py)
  1. die with the parent; ignore SIGINT (the supervisor decides when we stop)
  2. pin to our cores and set OMP/MKL thread variables -- before torch is imported
  3. import torch; set thread counts; pick the device           (failure: exit 3, boot error)
  4. LOADING: load our own copy of the model                    (failure: exit 4, load error)
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

import zmq

from modelwarden.shared.config import WorkerSpec
from modelwarden.shared.logs import setup_logging
from modelwarden.shared.states import (EXIT_BOOT_ERROR, EXIT_LOAD_ERROR, EXIT_ORPHANED, EXIT_WARMUP_ERROR,
                           WorkerState)
from modelwarden.worker.placement import PlacementError, die_with_parent, pin_cpu

logger = logging.getLogger(__name__)
BASELINE_RUNS = 5


def run(spec: WorkerSpec, buffer_pair=None) -> None:
    """``buffer_pair``: our end of the socket pair the supervisor passes buffer descriptors on."""
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
    channel = _connect(spec)
    if boot_error is not None:
        _fail(channel, "boot", boot_error, EXIT_BOOT_ERROR)
    sys.exit(_boot_and_serve(spec, channel, buffer_pair))


def _set_title(spec: WorkerSpec) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(f"modelwarden: worker {spec.worker_id} {spec.placement}")
    except ImportError:
        pass


def _connect(spec: WorkerSpec):
    from modelwarden.worker.serve import Channel  # imports torch: only after pinning

    context = zmq.Context(1)
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, spec.identity)
    socket.setsockopt(zmq.LINGER, 2000)
    socket.connect(spec.backend)
    channel = Channel(socket)
    channel.hello(spec.secret)
    spec.secret = b""  # sent; the model's code has no business with it
    return channel


def _fail(channel, stage: str, message: str, code: int) -> None:
    logger.error("%s failed: %s", stage, message)
    channel.failed(stage, message)
    channel.socket.close(linger=2000)  # let the failure reach the supervisor before we exit
    sys.exit(code)


def _boot_and_serve(spec: WorkerSpec, channel, buffer_pair) -> int:
    import torch

    from modelwarden.worker.loader import LoadError, example_inputs, load_model, probe_inputs
    from modelwarden.worker.placement import configure_torch
    from modelwarden.worker.serve import WorkerServer

    try:
        device = configure_torch(spec)
    except Exception as exc:  # an absent device, a CUDA error: the worker cannot be placed
        _fail(channel, "boot", f"{type(exc).__name__}: {exc}" if not isinstance(exc, PlacementError)
              else str(exc), EXIT_BOOT_ERROR)
    channel.state(WorkerState.LOADING.value, pid=os.getpid(), device=str(device),
                  cores=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
                  interop_threads=torch.get_num_interop_threads())
    try:
        model = load_model(spec, device)
    except LoadError as exc:
        _fail(channel, "load", str(exc), EXIT_LOAD_ERROR)
    channel.state(WorkerState.WARMING.value)
    try:
        _warm_up(spec, model, device, example_inputs, probe_inputs)
        probe_args = probe_inputs(spec, device) if spec.model.probes_enabled else ()
        baseline_us = _baseline(spec, model, probe_args) if probe_args else None
    except Exception as exc:
        _fail(channel, "warmup", f"{type(exc).__name__}: {exc}", EXIT_WARMUP_ERROR)
    parent = multiprocessing.parent_process()
    if spec.standby is not None:
        code = _stand_by(spec, channel, parent, baseline_us)
        if code is not None:
            return code
    channel.state(WorkerState.READY.value, threads=torch.get_num_threads(),
                  interop_threads=torch.get_num_interop_threads(),
                  cores=sorted(os.sched_getaffinity(0)), device=str(device),
                  probe_baseline_us=baseline_us)
    logger.info("READY on %s with %d thread(s)", spec.placement, torch.get_num_threads())
    gc.freeze()  # the model and torch's own objects live forever: don't rescan them every pass
    server = WorkerServer(spec, model, device, channel, parent.sentinel if parent else None,
                          probe_args, buffer_pair)
    return server.serve()


def _stand_by(spec: WorkerSpec, channel, parent, baseline_us) -> int | None:
    """Report STANDBY and wait; None once promoted (``spec`` is the slot's now), else the
    exit code."""
    import torch

    from modelwarden.worker.standby import wait_for_promotion

    channel.state(WorkerState.STANDBY.value, threads=torch.get_num_threads(),
                  cores=sorted(os.sched_getaffinity(0)), probe_baseline_us=baseline_us)
    logger.info("STANDBY on %s with %d thread(s)", spec.placement, torch.get_num_threads())
    gc.freeze()
    return wait_for_promotion(spec, channel, parent.sentinel if parent else None)


def _warm_up(spec: WorkerSpec, model, device, example_inputs, probe_inputs) -> None:
    """Run every operator once before traffic: thread pools, allocator caches, cuDNN choices."""
    import torch

    if not spec.model.warmup:
        return
    if spec.model.inputs:
        inputs = [example_inputs(spec, seed, device) for seed in range(min(spec.model.warmup, 4))]
    else:  # no declared inputs: the probe's input file is the example (the config demands one)
        inputs = [probe_inputs(spec, device)]
    with torch.inference_mode():
        for iteration in range(spec.model.warmup):
            model(*inputs[iteration % len(inputs)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _baseline(spec: WorkerSpec, model, probe_args: tuple) -> int:
    """This worker's own probe latency when healthy: later probes are judged against it."""
    import torch

    timings = []
    for _ in range(BASELINE_RUNS):
        started = time.perf_counter_ns()
        with torch.inference_mode():
            model(*probe_args)
        if probe_args and probe_args[0].device.type == "cuda":
            torch.cuda.synchronize()
        timings.append((time.perf_counter_ns() - started) // 1000)
    return int(statistics.median(timings))
