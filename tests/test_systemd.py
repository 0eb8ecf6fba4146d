"""The unit under a real systemd: systemd/modelwarden.service and systemd/modelwarden.toml as
shipped, installed as docs/OPERATIONS.md says, in a container that boots systemd.

The container is this machine's own root, seen through an overlay whose upper layer is a tmpfs
(so nothing it does reaches the host), booted with ``systemd-nspawn -b`` in a private mount
namespace (``unshare -m``: the mounts vanish with it). In it, before the boot: a fresh machine
id, the user ``modelwarden`` and a client user in its group, a venv made with /usr/bin/python3
(so that user can run it) holding our wheel, the unit and the config. The venv borrows torch
and the other dependencies from the tests' own environment, bound read-only into the container.
One drop-in shortens timings only (WatchdogSec=8, RestartSec=1: a SIGSTOPped supervisor is found
out in seconds, yet one starting on a loaded machine is not mistaken for a hung one); the
hardening is the shipped unit's.

Checks, in order, against the one container: ``systemctl start`` returns only once every worker
is READY; shared memory (memfds over buffers.sock, from a client of another user in the group)
and core pinning work under the hardening; journald keeps each line's priority (``journalctl -p
warning``); ``systemctl reload`` re-reads the configuration (a new model version) and returns
only once every worker has been replaced (RELOADING=1, then READY=1); a SIGSTOPped supervisor is killed by the watchdog and restarted; the
shipped ``[gateway]`` example, uncommented, serves a member of the clients' group over its Unix
sockets with a token (and refuses one without); ``systemctl stop`` leaves no process (the
gateway's included), socket or buffer; ``systemd-analyze security`` rates the unit at most
2.0.

Needs root, systemd-nspawn (installed with apt-get when missing and reachable) and an overlay
mount; skips saying which is missing. ``make test-systemd`` runs it alone.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import ROOT, poll_until

pytestmark = [pytest.mark.slow, pytest.mark.systemd]

DEPS = "/opt/modelwarden-deps"  # where the borrowed site-packages appear in the container
MODELWARDEN = "/opt/modelwarden/.venv/bin/modelwarden"
CONTROL = ["--control", "ipc:///run/modelwarden/control.sock"]

BOOT = """\
#!/bin/sh
# Runs in a private mount namespace: every mount below disappears when systemd-nspawn exits.
set -e
base="$1"; wheel="$2"; unit="$3"; config="$4"; deps="$5"
mount -t tmpfs -o mode=0755 modelwarden-test "$base"
mkdir "$base/upper" "$base/work" "$base/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$base/upper,workdir=$base/work" "$base/root"
root="$base/root"
# nspawn makes its own /dev/console, /dev/pts and /dev/shm; the host's must not be in the way.
rm -rf "$root/dev/console" "$root/dev/pts" "$root/dev/shm"
systemd-id128 new | tr -d '-' > "$root/etc/machine-id"
cp "$wheel" "$root/tmp/"
mount --rbind /dev "$root/dev"
mount -t proc proc "$root/proc"
chroot "$root" /bin/sh -e -c '
  useradd --system --user-group --home /opt/modelwarden modelwarden
  useradd --no-create-home --groups modelwarden --shell /usr/sbin/nologin mwclient
  install -d /opt/modelwarden /etc/modelwarden /etc/systemd/system/modelwarden.service.d
  /usr/bin/python3 -m venv /opt/modelwarden/.venv
  /opt/modelwarden/.venv/bin/pip install -q --no-index --no-deps --disable-pip-version-check /tmp/*.whl
'
umount -R "$root/dev" "$root/proc"
for site in "$root"/opt/modelwarden/.venv/lib/python3*/site-packages; do
  echo "$DEPS_IN_CONTAINER" > "$site/zz_borrowed_dependencies.pth"
done
cp "$unit" "$root/etc/systemd/system/modelwarden.service"
cp "$config" "$root/etc/modelwarden/modelwarden.toml"
printf '[Service]\\nWatchdogSec=8\\nRestartSec=1\\n' \\
  > "$root/etc/systemd/system/modelwarden.service.d/timings.conf"
echo prepared
exec systemd-nspawn -D "$root" --register=no --keep-unit --private-network \\
  --bind-ro="$deps:$DEPS_IN_CONTAINER" -b
"""


def run(command: list, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def why_it_cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts an overlay and boots a container with systemd-nspawn)"
    for tool in ("unshare", "nsenter", "chroot", "systemd-id128"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/bin/python3").exists():
        return "no /usr/bin/python3 to make the daemon's venv with"
    system = run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"])
    if system.stdout.strip() != str(sys.version_info[:2]):
        return (f"/usr/bin/python3 is {system.stdout.strip()}, the tests run {sys.version_info[:2]}:"
                " the daemon's venv could not borrow the tests' compiled dependencies")
    if shutil.which("systemd-nspawn") is None:
        install = run(["apt-get", "install", "-y", "-q", "systemd-container"], timeout=300)
        if install.returncode != 0 or shutil.which("systemd-nspawn") is None:
            return ("systemd-nspawn is missing and `apt-get install systemd-container` failed: "
                    + (install.stderr.strip().splitlines() or ["no output"])[-1])
    return None


class Container:
    """A booted container; ``sh`` runs a command in it (all its namespaces, as root)."""

    def __init__(self, nspawn: subprocess.Popen, log: Path) -> None:
        self.nspawn = nspawn
        self.log = log

    def leader(self) -> int:
        children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children").read_text().split()
        if not children:
            raise AssertionError(f"the container has no init:\n{self.log.read_text()[-3000:]}")
        return int(children[0])

    def sh(self, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
        if self.nspawn.poll() is not None:
            raise AssertionError(f"the container is gone:\n{self.log.read_text()[-3000:]}")
        return run(["nsenter", "-t", str(self.leader()), "-a", "/bin/sh", "-c", script], timeout)

    def out(self, script: str, timeout: float = 120) -> str:
        result = self.sh(script, timeout)
        assert result.returncode == 0, f"{script!r} -> {result.returncode}: {result.stderr}{result.stdout}"
        return result.stdout.strip()

    def show(self, *properties: str) -> dict[str, str]:
        text = self.out(f"systemctl show modelwarden.service -p {','.join(properties)}")
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def status(self) -> dict:
        return json.loads(self.out(f"{MODELWARDEN} status --json {' '.join(CONTROL)} || true"))


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    reason = why_it_cannot_run()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("systemd")
    wheel_dir = work / "wheel"
    build = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--disable-pip-version-check", "-q", "-w", str(wheel_dir), str(ROOT)], timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.glob("modelwarden-*.whl")
    base = work / "ns"
    base.mkdir()
    (work / "boot.sh").write_text(BOOT)
    log = work / "nspawn.log"
    env = {**os.environ, "DEPS_IN_CONTAINER": DEPS}
    with open(log, "wb") as sink:
        nspawn = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "/bin/sh", str(work / "boot.sh"), str(base),
             str(wheel), str(ROOT / "systemd" / "modelwarden.service"),
             str(ROOT / "systemd" / "modelwarden.toml"), sysconfig.get_paths()["purelib"]],
            stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env)
    box = Container(nspawn, log)
    try:
        def booted():
            if nspawn.poll() is not None:
                return "gone"
            try:
                state = box.sh("systemctl is-system-running", timeout=10).stdout.strip()
            except (AssertionError, subprocess.TimeoutExpired, OSError):
                return None
            return state if state in ("running", "degraded") else None

        if poll_until(booted, 120, interval=0.5, message="the container's systemd") == "gone":
            pytest.skip("systemd-nspawn could not boot this machine's root in an overlay: "
                        + log.read_text(errors="replace")[-600:])
        yield box
    finally:
        if nspawn.poll() is None:
            nspawn.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to power off
            try:
                nspawn.wait(60)
            except subprocess.TimeoutExpired:
                nspawn.kill()
                nspawn.wait(30)


def test_start_returns_only_once_every_worker_is_ready(container):
    started = container.sh("systemctl start modelwarden.service", timeout=300)
    assert started.returncode == 0, (started.stderr,
                                     container.out("journalctl -u modelwarden --no-pager | tail -40"))
    status = container.status()  # at once: what `systemctl start` returned to
    states = [worker["state"] for worker in status["workers"]]
    assert states == ["READY", "READY"], states
    shown = container.show("ActiveState", "StatusText")
    assert shown["ActiveState"] == "active" and shown["StatusText"] == "2/2 workers ready", shown
    assert container.out("stat -c '%U %a' /run/modelwarden") == "modelwarden 750"
    # The unit bounds what the service commits and runs (docs/OPERATIONS.md, "Limits under abuse").
    limits = container.show("MemoryMax", "TasksMax")
    total = int(container.out("awk '/MemTotal/ {print $2}' /proc/meminfo")) * 1024
    assert 0 < int(limits["MemoryMax"]) <= total * 0.81 and limits["TasksMax"] == "4096", limits


CLIENT = """
import torch
from modelwarden import Client
from modelwarden.examples import make_mlp
from modelwarden.client.client import control_request
x = torch.randn(512, 64)  # 128 KiB: over shm_threshold, so it travels in a memfd
with Client("ipc:///run/modelwarden/frontend.sock", timeout=30) as client:
    y = client.infer("mlp", x)
    status = control_request("ipc:///run/modelwarden/control.sock", {"type": "status"})["status"]
    assert torch.allclose(y, make_mlp(hidden=256)(x), atol=1e-5), "not the shipped model's answer"
with Client(timeout=30) as client:  # no endpoint: the system daemon's local frontend
    assert client.endpoint == "unix:///run/modelwarden/local.sock", client.endpoint
    assert torch.allclose(client.infer("mlp", x), y, atol=1e-5), "the local frontend's answer"
print(status["daemon"]["buffers"])
"""


def test_shared_memory_and_core_pinning_work_under_the_hardening(container):
    # a client as the docs have it: another user, a member of the daemon's group (shm_group)
    buffers = container.out("cd / && runuser -u mwclient -- /opt/modelwarden/.venv/bin/python -c "
                            + shlex.quote(CLIENT))
    assert int(buffers) >= 1, buffers  # the client's memfd was registered on buffers.sock
    for worker in container.status()["workers"]:
        allowed = container.out(f"grep Cpus_allowed_list /proc/{worker['pid']}/status").split()[-1]
        assert allowed == ",".join(str(core) for core in worker["cores"]), (worker, allowed)


def test_journald_keeps_each_lines_priority(container):
    victim = container.status()["workers"][0]["pid"]
    container.out(f"kill -KILL {victim}")

    def warned() -> str:
        return container.out("journalctl -u modelwarden -p warning -o cat --no-pager")

    lines = poll_until(lambda: f"pid {victim}" in warned() and warned(), 30,
                       message="the dead worker's WARNING in `journalctl -p warning`")
    assert "INFO" not in lines, lines  # INFO lines stay at priority 6, out of -p warning
    poll_until(lambda: all(w["state"] == "READY" for w in container.status()["workers"]), 90,
               message="the killed worker replaced")


def test_reload_rereads_the_config_and_returns_once_every_worker_is_replaced(container):
    """`systemctl reload` (SIGHUP) re-reads the configuration: a new version of the model rolls
    its workers. The daemon sends RELOADING=1 at once and READY=1 once every worker has been
    replaced: systemd keeps the unit "reloading", and `systemctl reload` waiting, until then."""
    before = {worker["pid"] for worker in container.status()["workers"]}
    container.out("sed -i 's/^kwargs = { hidden = 256 }$/&\\nversion = \"2\"/' "
                  "/etc/modelwarden/modelwarden.toml && grep -q '^version = \"2\"$' "
                  "/etc/modelwarden/modelwarden.toml")
    reload = container.sh("systemctl reload modelwarden.service")
    assert reload.returncode == 0, reload.stderr
    after = container.status()["workers"]  # at once: what `systemctl reload` returned to
    assert [w["state"] for w in after] == ["READY", "READY"], after
    assert [w["version"] for w in after] == ["2", "2"], after
    assert not before & {worker["pid"] for worker in after}, (before, after)
    gone = container.sh(" && ".join(f"! test -e /proc/{pid}" for pid in before))
    assert gone.returncode == 0, f"old workers still running after the reload: {before}"
    journal = container.out("journalctl -u modelwarden -o cat --no-pager")
    # ExecReload is `modelwarden reload`: the daemon has sent RELOADING=1 before it returns, so
    # systemd waits for READY=1 (with `kill -HUP` it could end the reload before the roll).
    assert "reload: " in journal and journal.rfind("Reloaded modelwarden") > journal.rfind("DRAINING ->")


def test_a_stopped_supervisor_is_killed_by_the_watchdog_and_restarted(container):
    shown = container.show("MainPID", "NRestarts")
    container.out(f"kill -STOP {shown['MainPID']}")
    poll_until(lambda: container.show("NRestarts")["NRestarts"] == str(int(shown["NRestarts"]) + 1),
               60, interval=0.2, message="a restart by the watchdog")
    journal = container.out("journalctl -u modelwarden -o cat --no-pager")
    assert "Watchdog timeout" in journal, journal[-2000:]
    started = container.sh("systemctl start modelwarden.service", timeout=300)  # waits for READY=1
    assert started.returncode == 0, started.stderr
    now = container.show("MainPID", "ActiveState")
    assert now["ActiveState"] == "active" and now["MainPID"] != shown["MainPID"], now


GATEWAY_CLIENT = """
import http.client, json, socket, sys
import numpy as np, tritonclient.grpc as triton
token = sys.argv[1]
class UnixConnection(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("/run/modelwarden/gateway-http.sock")
def post(headers):
    connection = UnixConnection("gw", timeout=30)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]})
    connection.request("POST", "/v2/models/mlp/infer", body=body, headers=headers)
    response = connection.getresponse()
    return response.status, json.loads(response.read())
found = {"without": post({})[0]}
found["with"], reply = post({"Authorization": "Bearer " + token})
found["rest_shape"] = reply["outputs"][0]["shape"]
client = triton.InferenceServerClient("unix:/run/modelwarden/gateway-grpc.sock")
x = triton.InferInput("x", [2, 64], "FP32"); x.set_data_from_numpy(np.ones((2, 64), np.float32))
found["grpc_shape"] = list(client.infer("mlp", [x], headers={"authorization": "Bearer " + token})
                           .as_numpy("output__0").shape)
print(json.dumps(found))
"""


def test_the_shipped_gateway_example_serves_the_clients_group_under_the_hardening(container):
    """The commented [gateway] of systemd/modelwarden.toml, uncommented as it is: Unix sockets in
    the RuntimeDirectory for the clients' group, a token file as OPERATIONS.md says to make it."""
    tokens = "/etc/modelwarden/gateway.tokens"
    token = container.out(f"{MODELWARDEN} token {tokens} --label mwclient 2>/dev/null && "
                          f"chgrp modelwarden {tokens} && chmod 640 {tokens}").splitlines()[-1]
    container.out("sed -i -E 's/^# (\\[gateway\\]|http = \"unix:|grpc = \"unix:|token_file = )/\\1/' "
                  "/etc/modelwarden/modelwarden.toml && grep -q '^\\[gateway\\]$' "
                  "/etc/modelwarden/modelwarden.toml")
    started = container.sh("systemctl restart modelwarden.service", timeout=300)
    assert started.returncode == 0, (started.stderr,
                                     container.out("journalctl -u modelwarden --no-pager | tail -40"))
    poll_until(lambda: container.status().get("gateway", {}).get("state") == "READY", 90,
               message="the gateway READY under systemd")
    assert container.status()["gateway"]["access"] == ["tokens"]
    for name in ("gateway-http.sock", "gateway-grpc.sock"):
        assert container.out(f"stat -c '%a %G' /run/modelwarden/{name}") == "660 modelwarden"
    found = json.loads(container.out("cd / && runuser -u mwclient -- /opt/modelwarden/.venv/bin/python "
                                     f"-c {shlex.quote(GATEWAY_CLIENT)} {token}"))
    assert found == {"without": 401, "with": 200, "rest_shape": [1, 10], "grpc_shape": [2, 10]}, found


def test_stop_leaves_no_process_socket_or_buffer(container):
    assert container.status()["workers"]
    stopped = container.sh("systemctl stop modelwarden.service", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert container.show("ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}
    left = container.sh("ps -u modelwarden -o pid=,args=").stdout.strip()
    assert not left, left
    assert container.sh("test -e /run/modelwarden").returncode != 0  # RuntimeDirectory= removed
    buffers = container.sh("ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c memfd:modelwarden").stdout.strip()
    assert buffers == "0", buffers
    journal = container.out("journalctl -u modelwarden -o cat --no-pager")
    stop = journal[journal.rfind("Stopping modelwarden"):]
    assert "SIGKILL" not in stop, stop  # everything left when asked; nothing had to be killed


def test_the_unit_is_rated_at_most_2_by_systemd_analyze_security(container):
    report = container.out("systemd-analyze security --no-pager modelwarden.service")
    exposure = float(re.search(r"Overall exposure level for modelwarden\.service: ([0-9.]+)",
                               report).group(1))
    assert exposure <= 2.0, report
