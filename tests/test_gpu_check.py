"""bench/gpu_check.py: what runs without a GPU (arguments, the report, the skip), the whole script
on a GPU machine, and how a CUDA worker's buffer maps page-lock client buffers (worker/hostpin.py,
with the CUDA runtime injected: the real one needs a device)."""

import io
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import gpu_check
from modelwarden.shared import fdchannel
from modelwarden.shared.shm import create_segment
from modelwarden.worker.hostpin import HostPinner
from modelwarden.worker.segments import SegmentMaps
from tests.helpers import ROOT

HAS_CUDA = torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device: the checks run instead")
def test_without_a_cuda_device_every_check_says_skipped_and_the_script_exits_zero():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"SKIP {name}: no CUDA device: skipped"
                                       for name in gpu_check.CHECKS]
    strict = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--require-gpu"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert strict.returncode == 2


def test_one_failed_check_makes_the_exit_status_non_zero():
    out = io.StringIO()
    report = gpu_check.Report(out)
    report.run("good", lambda: "fine")
    assert report.exit_code() == 0
    report.run("bad", lambda: gpu_check.require(False, "the worker ran on cuda:1"))
    assert out.getvalue().splitlines() == ["PASS good: fine",
                                           "FAIL bad: AssertionError: the worker ran on cuda:1"]
    assert report.exit_code() == 1


def test_a_recycle_check_needs_two_workers():
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--workers", "1"])
    assert exit_info.value.code == 2
    assert gpu_check.parse_args(["--workers", "3", "--seconds", "2"]).workers == 3


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_every_gpu_check_passes_on_a_gpu():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--seconds", "4"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert all(f"PASS {name}:" in run.stdout for name in gpu_check.CHECKS), run.stdout


class RecordingRuntime:
    """The two calls HostPinner makes on torch.cuda.cudart(), recorded; ``refuse`` makes every
    registration fail as a driver at its locked-memory limit would."""

    cudaError = SimpleNamespace(success=0)

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.refuse:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        del self.registered[address]
        return 0


def hand_over(maps: SegmentMaps, sender: socket.socket, token: str, size: int = 1 << 20):
    buffer = create_segment(size)
    buffer.array[:8] = range(8)
    fdchannel.send_message(sender, {"type": "buffers", "tokens": [token], "sizes": [buffer.size]},
                           [buffer.fd])
    return buffer, maps.get(token)


@pytest.mark.parametrize("refuse", [False, True])
def test_a_cuda_worker_pins_each_client_buffer_while_it_holds_it(refuse):
    runtime = RecordingRuntime(refuse)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maps = SegmentMaps(theirs, HostPinner(runtime))
    try:
        buffer, mapped = hand_over(maps, ours, "a")
        expected = {} if refuse else {mapped.address: mapped.size}
        assert runtime.registered == expected
        # pinned or not, the worker reads the client's bytes
        assert list(mapped.array[:8]) == list(range(8))
        maps.forget(["a"])
        assert runtime.registered == {} and len(maps) == 0
        buffer.close()
    finally:
        ours.close()
        theirs.close()


def test_a_cpu_worker_pins_nothing():
    assert HostPinner.for_device(torch.device("cpu")) is None
