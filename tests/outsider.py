"""What a member of the clients' group can and cannot do to a running daemon, and an impostor
that squats another user's fallback runtime directory.

Run by tests/test_privsep.py as an unprivileged user (setpriv), possibly with a system python
that reaches our virtual environment through ``site.addsitedir``:

    python tests/outsider.py SITE_PACKAGES RUNTIME_DIR
    python tests/outsider.py impostor RUNTIME_DIR READY_FILE
    python tests/outsider.py victim SITE_PACKAGES

The first prints one JSON object: what each attempt gave. The impostor (the standard library
only) makes RUNTIME_DIR as a daemon would look from outside -- a locked ``modelwarden.pid``,
listening ``frontend.sock``, ``control.sock`` and ``buffers.sock`` anyone may connect to --,
writes READY_FILE, and until SIGTERM accepts whatever connects; then it prints one JSON object
counting the connections on each socket. The victim, with no configuration, tries
``Client().infer``, ``AsyncClient().infer``, ``modelwarden status --json`` and
``modelwarden stop``, and prints what each gave. None makes a judgement; the test does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import site
import fcntl
import select
import signal
import socket
import sys
import time
from pathlib import Path


def main() -> None:
    if sys.argv[1] == "impostor":
        impostor(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    if sys.argv[1] == "victim":
        victim(sys.argv[2])
        return
    site.addsitedir(sys.argv[1])  # the venv's .pth files: the editable modelwarden install
    runtime = sys.argv[2]
    import numpy as np

    from modelwarden.client.client import Client, RemoteError, control_request

    control, admin = f"ipc://{runtime}/control.sock", f"ipc://{runtime}/private/admin.sock"
    found: dict = {"uid": os.getuid(), "groups": os.getgroups()}
    with Client(f"ipc://{runtime}/frontend.sock", timeout=20) as client:
        found["infer_shape"] = list(client.infer("mlp", np.ones((2, 64), np.float32)).shape)
    if os.path.exists(f"{runtime}/local.sock"):  # the local frontend (unix://), when served
        def ours() -> int:
            rows = control_request(control, {"type": "status"})["status"]["daemon"]["identities"]
            return next((row["connections"] for row in rows
                         if row["identity"] == f"uid:{os.getuid()}"), 0)

        with Client(f"unix://{runtime}/local.sock", timeout=20, shm=False) as client:
            found["local_infer_shape"] = list(client.infer("mlp", np.ones((2, 64), np.float32)).shape)
            during = ours()
        # Its close is counted at once (the loop reads the hang-up); the ipc client's may lag.
        deadline = time.monotonic() + 10
        while ours() >= during and time.monotonic() < deadline:
            select.select([], [], [], 0.05)
        found["local_connection_counted_as_ours"] = during - ours() >= 1
    found["status_ready"] = [m["ready"] for m in control_request(control, {"type": "status"})["status"]["models"]]
    for command, fields in (("stop", {}), ("restart", {}), ("reload", {}),
                            ("scale", {"model": "mlp", "workers": 3}), ("stop", {"target": "mlp"})):
        command = command + ("_target" if "target" in fields else "")
        try:
            control_request(control, {"type": command.removesuffix("_target"), **fields}, 5.0)
            found[f"{command}_on_control"] = "accepted"
        except RemoteError as exc:
            found[f"{command}_on_control"] = {"code": exc.code, "message": str(exc)}
    found["connect private/admin.sock"] = _unix_connect(f"{runtime}/private/admin.sock")
    found["client_on_admin"] = _client_error(admin)
    found["cli_stop"] = _cli(["stop", "--admin", admin, "--timeout", "2"])
    found["cli_status"] = _cli(["status", "--control", control])
    print(json.dumps(found))


def _unix_connect(path: str) -> str:
    """The kernel's answer to connect(2) on a unix socket path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return "connected"
    except OSError as exc:
        return type(exc).__name__
    finally:
        sock.close()


def _client_error(endpoint: str) -> str:
    from modelwarden.client.client import Client

    try:
        with Client(endpoint, timeout=2) as client:
            client.hello()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _cli(argv: list[str]) -> dict:
    from modelwarden.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as exc:  # how the CLI ends where it finds its socket
            code = exc.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def victim(site_packages: str) -> None:
    site.addsitedir(site_packages)
    import asyncio

    import numpy as np

    from modelwarden.client.client import AsyncClient, Client

    x = np.ones((2, 64), np.float32)
    found: dict = {}
    try:
        with Client(timeout=5) as client:
            found["client"] = f"served {client.infer('mlp', x).shape}"
    except Exception as exc:
        found["client"] = f"{type(exc).__name__}: {exc}"

    async def infer_async() -> str:
        async with AsyncClient(timeout=5) as client:
            return f"served {(await client.infer('mlp', x)).shape}"

    try:
        found["async_client"] = asyncio.run(infer_async())
    except Exception as exc:
        found["async_client"] = f"{type(exc).__name__}: {exc}"
    found["cli_status"] = _cli(["status", "--json", "--timeout", "5"])
    found["cli_stop"] = _cli(["stop", "--timeout", "5"])
    print(json.dumps(found))


# What ZeroMQ ipc, the local frontend and fdchannel use.
IMPOSTOR_SOCKETS = {"frontend.sock": socket.SOCK_STREAM, "local.sock": socket.SOCK_STREAM,
                    "control.sock": socket.SOCK_STREAM, "buffers.sock": socket.SOCK_SEQPACKET}


def impostor(runtime: Path, ready: Path) -> None:
    runtime.mkdir(mode=0o755)
    os.chmod(runtime, 0o755)
    lock = open(runtime / "modelwarden.pid", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    listeners = {}
    for name, kind in IMPOSTOR_SOCKETS.items():
        sock = socket.socket(socket.AF_UNIX, kind)
        sock.bind(str(runtime / name))
        os.chmod(runtime / name, 0o666)
        sock.listen(16)
        listeners[sock] = name
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))  # only records
    connections = {name: 0 for name in IMPOSTOR_SOCKETS}
    ready.write_text("listening\n")
    while not stopping:
        readable, _, _ = select.select(list(listeners), [], [], 0.1)
        for sock in readable:
            connections[listeners[sock]] += 1
            sock.accept()[0].close()
    print(json.dumps({"connections": connections}), flush=True)


if __name__ == "__main__":
    main()
