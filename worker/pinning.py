"""Put this worker on its cores (and device) before torch starts any thread pool.

Order matters: the affinity mask and OMP/MKL variables must be set before ``import torch`` spins
up OpenMP, and ``set_num_interop_threads`` must run before any inter-op work. So ``pin_cpu`` runs
first thing in the child, and ``configure_torch`` right after torch is imported.
"""

from __future__ import annotations

import logging
import os

from modelwarden.shared.config import WorkerSpec

logger = logging.getLogger(__name__)

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


class PlacementError(RuntimeError):
    """This worker cannot be placed as configured (absent device, unusable cores)."""


def pin_cpu(spec: WorkerSpec) -> None:
    try:
        os.sched_setaffinity(0, spec.cores)
    except OSError as exc:
        raise PlacementError(f"cannot pin to cores {spec.cores}: {exc}") from None
    for name in _THREAD_VARS:
        os.environ[name] = str(spec.threads)


def configure_torch(spec: WorkerSpec):
    """Thread counts and device; returns the torch.device to run on."""
    import torch

    torch.set_num_threads(spec.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set: only possible if something ran parallel work first
        logger.warning("inter-op thread count was already fixed before configure_torch")
    torch.set_grad_enabled(False)
    if not spec.device.startswith("cuda"):
        return torch.device("cpu")
    return _cuda_device(spec, torch)


def _cuda_device(spec: WorkerSpec, torch):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(spec.device.split(":")[1]) if ":" in spec.device else (
        spec.slot % count if count else 0)
    if index >= count:
        if spec.model.cuda_fallback_to_cpu:
            logger.warning("%s not available (%d CUDA devices); falling back to CPU as configured",
                           spec.device, count)
            return torch.device("cpu")
        raise PlacementError(f"device {spec.device} is not available: this machine has "
                             f"{count} CUDA device(s)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
