"""Test helpers: start the real daemon as a subprocess, poll with deadlines, read /proc."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

import zmq

from modelwarden.shared import protocol, shm

ROOT = Path(__file__).resolve().parent.parent


class DaemonGone(AssertionError):
    """The daemon under test exited: no poll for anything else can succeed any more."""


def poll_until(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
               message: str = "condition") -> Any:
    """Call ``condition`` until it returns something truthy; fail after ``timeout`` seconds.
    Waiting is done in zmq.Poller with no sockets, not time.sleep: a poll with a deadline.
    A DaemonGone fails at once (a crashed daemon must not cost the whole timeout)."""
    deadline = time.monotonic() + timeout
    idle = zmq.Poller()
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except DaemonGone:
            raise
        except Exception as exc:  # the condition may race with a restarting daemon
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}"
                                 + (f" (last error: {last_error!r})" if last_error else ""))
        idle.poll(int(interval * 1000))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + " }"
    raise TypeError(type(value))


def render_config(daemon: dict, models: list[dict]) -> str:
    lines = ["[daemon]"] + [f"{key} = {toml_value(value)}" for key, value in daemon.items()]
    for model in models:
        probe = model.get("probe")
        lines += ["", "[[models]]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in model.items() if key != "probe"]
        if probe:
            lines += ["[models.probe]"] + [f"{key} = {toml_value(value)}" for key, value in probe.items()]
    return "\n".join(lines) + "\n"


def mlp_model(name: str = "mlp", workers: int = 2, **extra: Any) -> dict:
    model = {"name": name, "source": "python:examples.models:make_mlp", "kwargs": {"hidden": 32},
             "workers": workers, "cores_per_worker": 1, "threads": 1, "warmup": 2,
             "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 64]}]}
    model.update(extra)
    return model


def faulty_model(name: str, fault: str = "none", workers: int = 1, **extra: Any) -> dict:
    kwargs = {"fault": fault, **extra.pop("kwargs", {})}
    model = {"name": name, "source": "python:tests.faulty:make_faulty", "kwargs": kwargs,
             "workers": workers, "cores_per_worker": 1, "threads": 1, "warmup": 2,
             "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 8]}]}
    model.update(extra)
    return model


def probe_files(tmp_path: Path, failures: int = 3) -> dict:
    """A probe table: an input and its golden output, computed here with the healthy reference
    (tests/faulty.py), so a drifting worker fails it."""
    import numpy as np
    import torch

    from tests.faulty import reference

    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(5))
    np.save(tmp_path / "probe_in.npy", x.numpy())
    np.save(tmp_path / "golden.npy", reference(x).numpy())
    return {"interval": 0.2, "input": str(tmp_path / "probe_in.npy"),
            "golden": str(tmp_path / "golden.npy"), "failures": failures, "latency_slack_ms": 5000}


def rewrite_config(daemon: "Daemon", models: list[dict], **daemon_settings: Any) -> None:
    """The daemon's configuration file with new models (and daemon keys, if given), for a
    reload to read."""
    current = tomllib.loads(daemon.config_path.read_text())
    daemon.config_path.write_text(render_config({**current["daemon"], **daemon_settings}, models))


class Daemon:
    """The real daemon in a subprocess, on a private runtime directory."""

    def __init__(self, models: list[dict], daemon: dict | None = None, env: dict | None = None,
                 extra_frontends: list[str] = (), nofile: int | None = None) -> None:
        # Short paths: a unix socket path is limited to 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="mw-", dir="/tmp"))
        settings = {"runtime_dir": str(self.dir / "run"), "allow_oversubscription": True,
                    "heartbeat_interval": 0.2,
                    "python_path": [str(ROOT)]}
        settings.update(daemon or {})
        if extra_frontends:
            settings["frontend"] = [f"ipc://{self.dir}/run/frontend.sock", *extra_frontends]
        self.config_path = self.dir / "modelwarden.toml"
        self.config_path.write_text(render_config(settings, models))
        self.log_path = self.dir / "daemon.log"
        self.env = {**os.environ, **(env or {})}
        self.env.pop("MODELWARDEN_CONFIG", None)
        self.nofile = nofile  # RLIMIT_NOFILE (soft = hard) for the daemon, if given
        self.process: subprocess.Popen | None = None
        self.endpoint = f"ipc://{self.dir}/run/frontend.sock"
        self.control = f"ipc://{self.dir}/run/control.sock"
        self.admin = f"ipc://{self.dir}/run/private/admin.sock"
        if "frontend" in settings:
            self.endpoint = settings["frontend"][0]

    def start(self) -> "Daemon":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "modelwarden", "serve", "--config", str(self.config_path)],
            cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=self._limit_fds if self.nofile else None)
        return self

    def _limit_fds(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def check_running(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise DaemonGone(f"daemon exited with {self.process.returncode}:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, timeout: float = 5.0, endpoint: str | None = None) -> dict:
        """On the admin socket, as the operator's ``modelwarden status`` asks (it is never
        paused: the control socket is, under a flood); ``endpoint`` to ask elsewhere."""
        from modelwarden.shared.client import control_request

        self.check_running()
        return control_request(endpoint or self.admin, {"type": "status"}, timeout)["status"]

    def command(self, command: str, **fields: Any) -> dict:
        """A control command on the socket the CLI would use: admin for mutating ones."""
        from modelwarden.shared.client import control_request
        from modelwarden.supervisor.commands import COMMANDS

        endpoint = self.admin if COMMANDS[command].mutating else self.control
        return control_request(endpoint, {"type": command, **fields}, 5.0)

    def workers(self, model: str | None = None, state: str | None = None) -> list[dict]:
        return [worker for worker in self.status()["workers"]
                if (model is None or worker["model"] == model)
                and (state is None or worker["state"] == state)]

    def wait_ready(self, timeout: float = 90.0, models: list[str] | None = None) -> dict:
        def all_ready():
            status = self.status(timeout=2.0)
            wanted = [m for m in status["models"] if models is None or m["name"] in models]
            return status if all(m["ready"] == m["workers"] for m in wanted) else None

        return poll_until(all_ready, timeout, message="every worker READY")

    def worker_pids(self) -> list[int]:
        return [worker["pid"] for worker in self.status()["workers"] if worker["pid"]]

    def stop(self, timeout: float = 30.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
            raise AssertionError(f"daemon did not stop within {timeout}s:\n{self.log()}")

    def cleanup(self) -> None:
        pids = []
        try:
            if self.process is not None and self.process.poll() is None:
                pids = self.worker_pids()
        except Exception:
            pass
        try:
            self.stop()
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._log.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def children_of(pid: int) -> list[int]:
    """Live child pids of ``pid``, from /proc (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


MEMFD_LINK = f"/memfd:{shm.MEMFD_NAME} (deleted)"


def memfd_holders(exclude: tuple[int, ...] = ()) -> dict[int, int]:
    """pid -> how many modelwarden buffer descriptors (``memfd:modelwarden``) it holds, for
    every process on the machine but ``exclude``."""
    holders: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone
            continue
        count = sum(1 for fd in fds if _readlink(f"/proc/{entry}/fd/{fd}") == MEMFD_LINK)
        if count:
            holders[int(entry)] = count
    return holders


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # closed while we looked
        return None


def fd_count(pid: int) -> int:
    """Descriptors ``pid`` holds, less the /proc files it reads for a moment (RSS sampling)."""
    links = [_readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    return sum(1 for link in links if link is not None and not link.startswith("/proc/"))


def shmem_kib() -> int:
    """/proc/meminfo's Shmem: shared memory in use machine-wide, memfds included."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem in /proc/meminfo")


def raw_request(endpoint: str, frames: list[bytes], timeout: float = 10.0) -> dict:
    """Send raw frames on a fresh DEALER and return the decoded reply header."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            raise AssertionError("no reply to a raw request")
        reply = sock.recv_multipart()
        return protocol.unpack_header(reply[1])
    finally:
        sock.close()


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def peak_rss_reset(pid: int) -> None:
    """Start a new VmHWM (peak resident memory) for ``pid`` from its resident memory now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def header_frame(header: dict) -> bytes:
    return protocol.pack(header)


def join_within(thread, timeout: float = 120.0) -> None:
    """Join a test thread, failing (not hanging) if it is still running after ``timeout``."""
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"thread {thread.name} still running after {timeout}s")


def readline_within(stream, timeout: float = 60.0) -> str:
    """One line from a subprocess pipe, or a failure after ``timeout`` (never a hang)."""
    idle = zmq.Poller()
    idle.register(stream.fileno(), zmq.POLLIN)
    if not idle.poll(int(timeout * 1000)):
        raise AssertionError(f"no line within {timeout}s")
    return stream.readline()


@contextlib.contextmanager
def temporary_user(prefix: str):
    """(user, group): a fresh group and a user whose primary group it is, removed afterwards."""
    suffix = secrets.token_hex(3)
    user, group = f"{prefix}u{suffix}", f"{prefix}g{suffix}"
    subprocess.run(["groupadd", group], check=True)
    try:
        subprocess.run(["useradd", "-M", "-N", "-g", group, "-s", "/usr/sbin/nologin", user], check=True)
        try:
            yield user, group
        finally:
            subprocess.run(["userdel", user], check=True)
    finally:
        subprocess.run(["groupdel", group], check=True)


def perf_analyzer() -> tuple[Path, dict] | str:
    """Triton's perf_analyzer (a C++ client in tritonclient's wheel) and the environment it
    loads in, or why it cannot run here."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    if not binary.exists():
        return "perf_analyzer is not installed (tritonclient's wheel ships it)"
    env = dict(os.environ)
    try:  # it links libcudart even to measure a CPU server: the gateway-test extra has it
        import nvidia.cuda_runtime

        lib = Path(list(nvidia.cuda_runtime.__path__)[0], "lib")
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    except ImportError:
        pass
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, env=env,
                          timeout=30)
    if done.returncode != 0:
        return (f"perf_analyzer cannot run here: {done.stderr.strip()[-160:]} "
                "(Debian: apt install libb64-0d)")
    return binary, env
