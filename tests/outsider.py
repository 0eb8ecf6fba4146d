"""What a member of the clients' group can and cannot do to a running daemon.

Run by tests/test_privsep.py as an unprivileged user (setpriv), possibly with a system python
that reaches our virtual environment through ``site.addsitedir``:

    python tests/outsider.py SITE_PACKAGES RUNTIME_DIR

Prints one JSON object: what each attempt gave. Makes no judgement; the test does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import site
import socket
import sys


def main() -> None:
    site.addsitedir(sys.argv[1])  # the venv's .pth files: the editable modelwarden install
    runtime = sys.argv[2]
    import numpy as np

    from modelwarden.shared.client import Client, RemoteError, control_request

    control, admin = f"ipc://{runtime}/control.sock", f"ipc://{runtime}/private/admin.sock"
    found: dict = {"uid": os.getuid(), "groups": os.getgroups()}
    with Client(f"ipc://{runtime}/frontend.sock", timeout=20) as client:
        found["infer_shape"] = list(client.infer("mlp", np.ones((2, 64), np.float32)).shape)
    found["status_ready"] = [m["ready"] for m in control_request(control, {"type": "status"})["status"]["models"]]
    for command, fields in (("stop", {}), ("restart", {}), ("reload", {}),
                            ("scale", {"model": "mlp", "workers": 3}), ("stop", {"target": "mlp"})):
        command = command + ("_target" if "target" in fields else "")
        try:
            control_request(control, {"type": command.removesuffix("_target"), **fields}, 5.0)
            found[f"{command}_on_control"] = "accepted"
        except RemoteError as exc:
            found[f"{command}_on_control"] = {"code": exc.code, "message": str(exc)}
    for name in ("private/backend.sock", "private/admin.sock"):
        found[f"connect {name}"] = _unix_connect(f"{runtime}/{name}")
    found["client_on_backend"] = _client_error(f"ipc://{runtime}/private/backend.sock")
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
    from modelwarden.shared.client import Client

    try:
        with Client(endpoint, timeout=2) as client:
            client.hello()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _cli(argv: list[str]) -> dict:
    from modelwarden.supervisor.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    main()
