"""Test helpers: the real daemon with the tests' defaults (on modelwarden/testing.py), fault
models, probe tables, /proc readings."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import secrets
import socket
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import zmq

from modelwarden.shared import protocol
# The harness (modelwarden/testing.py) is the package's, for tools and users' tests alike; the
# tests import these names from here, as they always have.
from modelwarden.testing import (DaemonGone, LocalDaemon, PollTimeout, memfd_holders,  # noqa: F401
                                 perf_analyzer, poll_until, render_config, toml_value)

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback TCP port nothing listens on, for a daemon to bind a moment later.

    Drawn below the kernel's ephemeral range, never from it (``bind(port 0)`` would): an
    outgoing connection takes its source port from that range, so a client's connect (or a
    ZeroMQ reconnect to a killed daemon, which on loopback can even connect to itself) can
    take a port from there between this check and the daemon's bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(10000, low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000..{low}")


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


class Daemon(LocalDaemon):
    """The real daemon in a subprocess, on a private runtime directory (modelwarden/testing.py),
    with the tests' defaults: a fast heartbeat, oversubscribed cores, this tree importable by
    the workers (tests/faulty.py), and the daemon started from the repository root."""

    def __init__(self, models: list[dict], daemon: dict | None = None, env: dict | None = None,
                 extra_frontends: list[str] = (), nofile: int | None = None,
                 local: bool = False, default_frontends: bool = False) -> None:
        # Short paths: a unix socket path is limited to 107 bytes.
        directory = Path(tempfile.mkdtemp(prefix="mw-", dir="/tmp"))
        settings = {"runtime_dir": str(directory / "run"), "allow_oversubscription": True,
                    "heartbeat_interval": 0.2,
                    "python_path": [str(ROOT)]}
        settings.update(daemon or {})
        # local: a unix:// frontend too (supervisor/routing/localfront.py), as ``self.local``.
        self.local = f"unix://{directory}/run/local.sock" if local else None
        if local:
            extra_frontends = [*extra_frontends, self.local]
        if extra_frontends:
            settings["frontend"] = [f"ipc://{directory}/run/frontend.sock", *extra_frontends]
        elif not default_frontends:
            # The tests' daemons serve ZeroMQ alone unless a test asks for more (``local``) or
            # for the daemon's own default, which adds the local frontend (default_frontends).
            settings.setdefault("frontend", [f"ipc://{directory}/run/frontend.sock"])
        self.nofile = nofile  # RLIMIT_NOFILE (soft = hard) for the daemon, if given
        super().__init__({"daemon": settings, "models": models}, env=env, cwd=ROOT,
                         directory=directory, preexec_fn=self._limit_fds if nofile else None)

    def _limit_fds(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))


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


class Gate:
    """Holds a model's only worker busy while requests queue behind it: ``request`` is one the
    model blocks on while the file ``path`` exists (tests/faulty.py's GATE value, say)."""

    def __init__(self, daemon: Daemon, client, model: str, request: Any, path: Path,
                 wait: float = 60.0) -> None:
        self.daemon, self.client, self.model = daemon, client, model
        self.request, self.path, self.wait = request, path, wait

    def __enter__(self) -> "Gate":
        self.path.touch()
        self.busy = self.client.submit(self.model, self.request, timeout=self.wait)
        poll_until(lambda: self.daemon.workers(self.model)[0]["inflight"] == 1, self.wait,
                   message="the worker busy with the gated request")
        return self

    def queue(self, count: int) -> None:
        """Wait until ``count`` requests are queued behind the gate."""
        poll_until(lambda: self.daemon.status()["models"][0]["queued"] == count, self.wait,
                   message=f"{count} requests queued behind the gate")

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)
        self.busy.result(self.wait)


def shipped_model(config: str, **overrides: Any) -> dict:
    """The first model of examples/``config``, its probe files made absolute (a test's config
    lives elsewhere); ``overrides`` replace its keys, ``probe`` merging into its probe table."""
    model = tomllib.loads((ROOT / "examples" / config).read_text())["models"][0]
    probe = model["probe"]
    for key in ("input", "golden"):
        probe[key] = str(ROOT / "examples" / probe[key])
    model.update(overrides)
    model["probe"] = {**probe, **overrides.get("probe", {})}
    return model

