"""The GPU paths, proved on a real GPU: a few minutes, one line per check, non-zero on a failure.

    python bench/gpu_check.py [--workers 2] [--seconds 8] [--require-gpu]

Checks (each prints ``PASS name: ...``, ``FAIL name: ...`` or ``SKIP name: ...``):
  devices     every worker runs on the device ``status`` says it has (a model reports its
              tensors' device index from inside forward)
  streams     every worker runs forward on its own stream, not the legacy default stream
  pinned      a client buffer mapped by a CUDA worker's SegmentMaps is page-locked
              (``is_pinned()``), reaches the device by a non_blocking copy intact, and is
              unpinned when forgotten; and a 4 MiB input sent through shared memory comes back right
  oom         a CUDA OOM in forward answers OUT_OF_MEMORY; that worker alone is replaced
  recycle     a worker holding more CUDA memory than ``max_cuda_memory`` is replaced; the others are not
  memory      CUDA memory per worker in ``status`` (``cuda_bytes``) and /metrics
              (``modelwarden_worker_cuda_bytes``); sentinel probes pass on the GPU workers
  throughput  a busy model (16 matmuls of 2048) on one GPU: requests/s with 1 worker and with N
Without a CUDA device every check is ``SKIP ...: no CUDA device: skipped`` and the exit status is
0 (2 with ``--require-gpu``). Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECKS = ("devices", "streams", "pinned", "oom", "recycle", "memory", "throughput")
NO_DEVICE = "no CUDA device: skipped"


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


class Report:
    """Outcomes in order; ``run`` turns an exception (or a False) into a FAIL line."""

    def __init__(self, out=sys.stdout) -> None:
        self.outcomes: list[Outcome] = []
        self.out = out

    def add(self, name: str, status: str, detail: str) -> None:
        outcome = Outcome(name, status, detail)
        self.outcomes.append(outcome)
        print(outcome.line(), file=self.out, flush=True)

    def run(self, name: str, check: Callable[[], str]) -> None:
        try:
            self.add(name, "PASS", check())
        except Exception as exc:
            self.add(name, "FAIL", f"{type(exc).__name__}: {exc}")

    def skip_all(self, reason: str) -> None:
        for name in CHECKS:
            self.add(name, "SKIP", reason)

    def exit_code(self) -> int:
        return 1 if any(outcome.status == "FAIL" for outcome in self.outcomes) else 0


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- the daemon -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def model_table(name: str, source: str, devices: list[str], width: int = -1, **extra) -> str:
    from modelwarden.testing import toml_value  # the harness's TOML writer: one way to write a config

    lines = ["[[models]]", f'name = "{name}"', f'source = "{source}"', f"workers = {len(devices)}",
             f"device = {toml_value(devices)}", "threads = 1", "warmup = 2",
             f'inputs = [{{ name = "x", dtype = "float32", shape = [-1, {width}] }}]']
    probe = extra.pop("probe", None)
    lines += [f"{key} = {toml_value(value)}" for key, value in extra.items()]
    if probe:
        lines += ["[models.probe]"] + [f"{key} = {toml_value(value)}" for key, value in probe.items()]
    return "\n".join(lines) + "\n"


class GpuDaemon:
    """The real daemon on a private runtime directory, with /metrics on a loopback port."""

    def __init__(self, workdir: Path, models: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpu-", dir=workdir))
        self.port = free_port()
        config = self.dir / "gpu.toml"
        config.write_text(f'[daemon]\nruntime_dir = "{self.dir / "run"}"\nallow_oversubscription = true\n'
                          f'heartbeat_interval = 0.2\npython_path = ["{ROOT}"]\n'
                          f'metrics = "127.0.0.1:{self.port}"\n\n{models}')
        self.log = open(self.dir / "daemon.log", "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "modelwarden", "serve", "--config",
                                         str(config)], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.endpoint = f"ipc://{self.dir}/run/frontend.sock"

    def status(self) -> dict:
        from modelwarden.client.control import control_request

        return control_request(f"ipc://{self.dir}/run/control.sock", {"type": "status"}, 5.0)["status"]

    def workers(self, model: str) -> list[dict]:
        return [w for w in self.status()["workers"] if w["model"] == model and w["pid"]]

    def wait(self, condition: Callable[[], object], timeout: float, what: str):
        from modelwarden.testing import DaemonGone, poll_until

        def alive_and(condition=condition):
            if self.process.poll() is not None:  # fails the poll at once, not at its deadline
                raise DaemonGone(f"the daemon exited:\n{self.tail()}")
            return condition()

        return poll_until(alive_and, timeout, interval=0.1, message=what)

    def wait_ready(self, timeout: float = 180.0) -> dict:
        return self.wait(lambda: (lambda s: s if all(m["ready"] == m["workers"] for m in s["models"])
                                  else None)(self.status()), timeout, "every worker READY")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as page:
            return page.read().decode()

    def tail(self) -> str:
        return (self.dir / "daemon.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


# -- the checks -------------------------------------------------------------------------------


def where_answers(daemon: GpuDaemon, model: str, count: int) -> dict[str, list[int]]:
    """worker id -> [device index, stream handle] from its own forward, every worker answering."""
    import torch

    from modelwarden import Client

    from bench.gpu_models import REPORT_MARKER

    seen: dict[str, list[int]] = {}
    with Client(daemon.endpoint) as client:
        def everyone() -> bool:
            reply = client.infer(model, torch.full((2, 4), REPORT_MARKER), details=True)
            seen[reply.worker] = reply.outputs[1].tolist()
            return len(seen) == count

        daemon.wait(everyone, 60, f"answers from all {count} workers")
    return seen


def check_devices(daemon: GpuDaemon, answers: dict, expected: list[str]) -> str:
    rows = {w["id"]: w for w in daemon.workers("where")}
    for worker, (index, _) in answers.items():
        said = rows[worker]["device"]
        require(said == f"cuda:{index}", f"{worker}: status says {said}, its forward ran on cuda:{index}")
    configured = sorted(expected)
    placed = sorted(rows[w]["device"] for w in answers) if all(":" in d for d in configured) else None
    require(placed is None or placed == configured, f"placed on {placed}, configured {configured}")
    return ", ".join(f"{w} on {rows[w]['device']}" for w in sorted(answers))


def check_streams(answers: dict) -> str:
    streams = {worker: stream for worker, (_, stream) in answers.items()}
    default = [worker for worker, stream in streams.items() if stream == 0]
    require(not default, f"{default} ran forward on the legacy default stream")
    return ", ".join(f"{w} stream {hex(s)}" for w, s in sorted(streams.items()))


def check_pinned_segments() -> str:
    import torch

    from modelwarden.shared import fdchannel
    from modelwarden.shared.shm import create_segment
    from modelwarden.worker.hostpin import HostPinner
    from modelwarden.worker.segments import SegmentMaps

    device = torch.device("cuda", 0)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maps = SegmentMaps(theirs, HostPinner.for_device(device))
    buffer = create_segment(4 << 20)
    buffer.array[:] = torch.arange(buffer.size, dtype=torch.int64).remainder(251).to(torch.uint8).numpy()
    fdchannel.send_message(ours, {"type": "buffers", "tokens": ["t"], "sizes": [buffer.size]}, [buffer.fd])
    mapped = torch.from_numpy(maps.get("t").array)
    require(mapped.is_pinned(), "the mapped client buffer is not page-locked")
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        on_device = mapped.to(device, non_blocking=True)
    stream.synchronize()
    require(torch.equal(on_device.cpu(), torch.from_numpy(buffer.array)), "the copy differs")
    maps.forget(["t"])
    require(not mapped.is_pinned(), "still page-locked after forget")
    ours.close()
    buffer.close()
    return "a 4 MiB client buffer: pinned while mapped, DMA copy intact, unpinned on forget"


def check_shm_roundtrip(daemon: GpuDaemon) -> str:
    import torch

    from modelwarden import Client

    x = torch.randn(1024, 1024)  # 4 MiB: above shm_threshold, so it travels in shared memory
    with Client(daemon.endpoint, shm=True) as client:
        doubled, _ = client.infer("where", x)
    require(torch.equal(doubled, 2 * x), "a shared-memory input came back wrong")
    return "a 4 MiB shared-memory input came back doubled, exactly"


def require_replaced_alone(daemon: GpuDaemon, before: dict, worker: str, why: str) -> None:
    """``worker`` gets a new READY process (waited for); every other worker keeps its pid."""
    daemon.wait(lambda: any(w["id"] == worker and w["pid"] != before[worker] and w["state"] == "READY"
                            for w in daemon.workers("where")), 120, f"{worker} replaced {why}")
    after = {w["id"]: w["pid"] for w in daemon.workers("where") if w["state"] == "READY"}
    kept = {w: pid for w, pid in before.items() if w != worker}
    require(all(after.get(w) == pid for w, pid in kept.items()), f"others restarted: {before} -> {after}")


def check_oom(daemon: GpuDaemon) -> str:
    import torch

    from modelwarden import Client
    from modelwarden.shared.errors import OutOfMemory

    from bench.gpu_models import OOM_MARKER

    before = {w["id"]: w["pid"] for w in daemon.workers("where")}
    with Client(daemon.endpoint) as client:
        try:
            client.infer("where", torch.full((1, 4), OOM_MARKER), details=True)
            raise AssertionError("a 64 TiB allocation in forward did not fail")
        except OutOfMemory as exc:
            failed = exc.worker
        for _ in range(4 * len(before)):
            client.infer("where", torch.ones(1, 4))
    require_replaced_alone(daemon, before, failed, "after its OOM")
    return f"OUT_OF_MEMORY from {failed}; it alone was replaced, the others served on"


def check_recycle(daemon: GpuDaemon, limit: int) -> str:
    import torch

    from modelwarden import Client

    from bench.gpu_models import HOLD_MARKER

    before = {w["id"]: w["pid"] for w in daemon.workers("where")}
    with Client(daemon.endpoint) as client:
        holder = client.infer("where", torch.full((1, 4), HOLD_MARKER), details=True).worker
    require_replaced_alone(daemon, before, holder, "over max_cuda_memory")
    return f"{holder} held 1 GiB > max_cuda_memory {limit >> 20} MiB and was replaced; others kept"


def check_memory(daemon: GpuDaemon) -> str:
    rows = daemon.wait(lambda: (lambda ws: ws if ws and all(w["cuda_bytes"] for w in ws) else None)(
        daemon.workers("where")), 30, "cuda_bytes of every worker in status")
    page = daemon.metrics()
    gauges = [line for line in page.splitlines() if line.startswith("modelwarden_worker_cuda_bytes{")]
    require(len(gauges) >= len(rows), f"{len(gauges)} cuda gauges for {len(rows)} workers in /metrics")
    probed = daemon.wait(lambda: (lambda ws: ws if all(w["probe"] and w["probe"]["ok"]
                                                        and w["probe"]["cuda_bytes"] for w in ws) else None)(
        daemon.workers("where")), 60, "a passing probe with its cuda_bytes on every GPU worker")
    return (f"status cuda_bytes {[w['cuda_bytes'] for w in rows]}, {len(gauges)} gauges in /metrics, "
            f"probes pass holding {[w['probe']['cuda_bytes'] for w in probed]} bytes")


def throughput(workdir: Path, workers: int, seconds: float) -> float:
    import torch

    from modelwarden import Client

    daemon = GpuDaemon(workdir, model_table("busy", "python:bench.gpu_models:make_busy",
                                            ["cuda:0"] * workers, width=2048, max_inflight=2))
    try:
        daemon.wait_ready()
        x = torch.randn(64, 2048)
        done, errors = [0], []
        deadline = time.monotonic() + seconds

        def caller() -> None:
            with Client(daemon.endpoint) as client:
                while time.monotonic() < deadline:
                    try:
                        client.infer("busy", x)
                        done[0] += 1
                    except Exception as exc:
                        errors.append(exc)

        threads = [threading.Thread(target=caller) for _ in range(2 * workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        require(not errors, f"{len(errors)} errors, first: {errors[:1]}")
        return done[0] / seconds
    finally:
        daemon.close()


def check_throughput(workdir: Path, workers: int, seconds: float) -> str:
    one = throughput(workdir, 1, seconds)
    many = throughput(workdir, workers, seconds)
    require(one > 0 and many > 0, "no requests answered")
    return f"1 worker {one:.1f} req/s, {workers} workers {many:.1f} req/s on cuda:0 ({many / one:.2f}x)"


def run_checks(report: Report, workers: int, seconds: float) -> None:
    count = cuda_devices()
    devices = [f"cuda:{i % count}" for i in range(workers)] if count > 1 else ["cuda"] * workers
    limit = 512 << 20
    workdir = Path(tempfile.mkdtemp(prefix="mw-gpu-", dir="/tmp"))
    daemon = GpuDaemon(workdir, model_table("where", "python:bench.gpu_models:make_where", devices,
                                            max_cuda_memory=limit, probe={"interval": 1.0}))
    try:
        daemon.wait_ready()
        answers = where_answers(daemon, "where", workers)
        report.run("devices", lambda: check_devices(daemon, answers, devices))
        report.run("streams", lambda: check_streams(answers))
        report.run("pinned", lambda: check_pinned_segments() + "; " + check_shm_roundtrip(daemon))
        report.run("oom", lambda: check_oom(daemon))
        report.run("memory", lambda: check_memory(daemon))
        report.run("recycle", lambda: check_recycle(daemon, limit))
    except Exception as exc:  # the daemon never served: every check it carries fails
        for name in ("devices", "streams", "pinned", "oom", "memory", "recycle"):
            if name not in {outcome.name for outcome in report.outcomes}:
                report.add(name, "FAIL", f"{type(exc).__name__}: {exc}")
    finally:
        daemon.close()
    report.run("throughput", lambda: check_throughput(workdir, workers, seconds))
    shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="workers per model (>= 2)")
    parser.add_argument("--seconds", type=float, default=8.0, help="per throughput point")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit 2 instead of 0 when there is no CUDA device")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (a recycle must leave the others untouched)")
    return args


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    args = parse_args(argv)
    report = Report(out)
    if cuda_devices() == 0:
        report.skip_all(NO_DEVICE)
        return 2 if args.require_gpu else 0
    print(f"{cuda_devices()} CUDA device(s); {args.workers} workers; pid {os.getpid()}", file=out)
    run_checks(report, args.workers, args.seconds)
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
