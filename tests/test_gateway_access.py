"""Who may call the KServe gateway: bearer tokens from ``token_file``, and ``unix:`` listeners
whose file mode lets in only the clients' group (gateway/access.py, gateway/main.py).

A gateway on 127.0.0.1 is reachable by every local user, where the daemon's own ipc frontend
lets in only ``shm_group``: these are the two ways to close that door, tested with the real
daemon, its real gateway process, tritonclient, raw HTTP, and real users made here."""

from __future__ import annotations

import concurrent.futures
import grp
import hashlib
import http.client
import json
import threading
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_gateway import (MLP, gateway_daemon, gateway_row, grpcclient, httpclient, infer,
                                mlp_requests)
from tritonclient.utils import InferenceServerException  # noqa: E402

from modelwarden.gateway import access  # noqa: E402
from tests.helpers import (alive, mlp_model, peak_rss, peak_rss_reset, poll_until,  # noqa: E402
                           rss_bytes, temporary_user)

ROOT = Path(__file__).resolve().parent.parent
MODELS = [mlp_model("mlp", workers=1, outputs=[{"name": "logits", "dtype": "float32", "shape": [-1, 10]}])]
X = np.arange(128, dtype=np.float32).reshape(2, 64) / 100


def expected() -> np.ndarray:
    with torch.no_grad():
        return MLP(torch.from_numpy(X)).numpy()


def modelwarden_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelwarden.cli", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def new_token(path: Path, label: str | None = None) -> str:
    done = modelwarden_cli("token", str(path), *(["--label", label] if label else []))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def rest(address: str, method: str, path: str, token: str | None = None,
         body: bytes | None = None) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    connection = http.client.HTTPConnection(address, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null"), dict(response.getheaders())
    finally:
        connection.close()


def grpc_refusal(call) -> str | None:
    """The status of a tritonclient gRPC call that fails (None when it succeeds)."""
    try:
        call()
    except InferenceServerException as exc:
        return exc.status()
    return None


def rest_infer(address: str, token: str | None) -> tuple[int, dict]:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 64],
                                   "data": X.reshape(-1).tolist()}]}).encode()
    status, reply, _ = rest(address, "POST", "/v2/models/mlp/infer", token, body)
    return status, reply


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "gateway.tokens"
    new_token(path, label="the module's first caller")
    return path


@pytest.fixture(scope="module")
def daemon(token_file):
    with gateway_daemon(MODELS, {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0",
                                 "token_file": str(token_file)}) as instance:
        instance.wait_ready()
        gateway_row(instance)
        yield instance


def first_token(path: Path) -> str:
    return next(line for line in path.read_text().splitlines() if line and not line.startswith("#"))


# -- tokens ---------------------------------------------------------------------------------------


def test_the_token_cli_writes_a_private_file_the_gateway_accepts(tmp_path):
    path = tmp_path / "tokens"
    first, second = new_token(path, "alice"), new_token(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text() == f"# alice\n{first}\n{second}\n"
    assert first != second and len(first) >= 43  # 32 random bytes, base64
    assert len(access.read_tokens(path)) == 2
    assert modelwarden_cli("token", str(path), "--label", "a\nb").returncode != 0


def test_without_a_token_only_the_health_checks_answer(daemon, token_file):
    row = gateway_row(daemon)
    before = mlp_requests(daemon)
    assert rest(row["http"], "GET", "/v2/health/live")[:2] == (200, {"live": True})
    assert rest(row["http"], "GET", "/v2/health/ready")[:2] == (200, {"ready": True})
    for token in (None, "not-the-token-at-all-0123456789", first_token(token_file) + "x"):
        for method, path in (("GET", "/v2"), ("GET", "/v2/models/mlp"), ("GET", "/v2/models/mlp/ready"),
                             ("GET", "/v2/models/mlp/config"), ("GET", "/v2/models/nope")):
            status, body, headers = rest(row["http"], method, path, token)
            assert status == 401 and body["error"].startswith("UNAUTHENTICATED: "), (path, body)
            assert headers["www-authenticate"] == access.CHALLENGE
        status, body = rest_infer(row["http"], token)
        assert status == 401, body

        grpc = grpcclient.InferenceServerClient(row["grpc"])
        headers = {"authorization": f"Bearer {token}"} if token else None
        assert grpc.is_server_live(headers=headers) and grpc.is_server_ready(headers=headers)
        for call in (lambda: grpc.get_server_metadata(headers=headers),
                     lambda: grpc.get_model_metadata("mlp", headers=headers),
                     lambda: grpc.is_model_ready("mlp", headers=headers),
                     lambda: grpc.get_model_config("mlp", headers=headers),
                     lambda: infer(grpc, grpcclient, "mlp", {"x": X}, {"x": "FP32"}, headers=headers)):
            assert grpc_refusal(call) == "StatusCode.UNAUTHENTICATED"
        grpc.close()
    assert mlp_requests(daemon) == before  # refused before anything reached the daemon
    assert daemon.status()["gateway"]["restarts"] == 0
    assert daemon.status()["gateway"]["access"] == ["tokens"]


def large_infer_message(nbytes: int) -> bytes:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\1" * nbytes])
    request.inputs.add(name="x", datatype="FP32", shape=[nbytes // 256, 64])
    return request.SerializeToString()


GRPC_FLOOD_CALLS, GRPC_FLOOD_BYTES = 4, 64 * 1024 * 1024
GRPC_FLOOD_RSS_BOUND = 64 * 1024 * 1024


def test_grpc_refuses_a_call_without_a_token_before_reading_its_message(daemon):
    """4 concurrent 64 MiB ModelInfer calls without a token: read, they would cost the gateway
    256 MiB and more (the message, then its parse); refused from the metadata, next to nothing."""
    import grpc as grpc_module

    pid = gateway_row(daemon)["pid"]
    message = large_infer_message(GRPC_FLOOD_BYTES)
    before = rss_bytes(pid)
    peak_rss_reset(pid)
    with grpc_module.insecure_channel(gateway_row(daemon)["grpc"]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        started = time.monotonic()
        futures = [call.future(message, timeout=60) for _ in range(GRPC_FLOOD_CALLS)]
        codes = [future.exception().code() for future in futures]
        took = time.monotonic() - started
    peak = peak_rss(pid)
    print(f"gateway RSS {before / 2**20:.0f} MiB, peak during the flood {peak / 2**20:.0f} MiB, "
          f"{GRPC_FLOOD_CALLS} refusals in {took:.2f}s")
    assert codes == [grpc_module.StatusCode.UNAUTHENTICATED] * GRPC_FLOOD_CALLS
    assert peak - before < GRPC_FLOOD_RSS_BOUND, (before, peak)
    assert took < 10
    assert daemon.status()["gateway"]["pid"] == pid


def test_with_a_token_tritonclient_works_unchanged(daemon, token_file):
    row = gateway_row(daemon)
    token = first_token(token_file)
    http_client = httpclient.InferenceServerClient(row["http"])
    grpc_client = grpcclient.InferenceServerClient(row["grpc"])
    try:
        # Triton's clients carry any header a caller gives them; gRPC metadata is lowercase.
        for client, module, key in ((http_client, httpclient, "Authorization"),
                                    (grpc_client, grpcclient, "authorization")):
            headers = {key: f"Bearer {token}"}
            assert client.is_model_ready("mlp", headers=headers)
            assert client.get_model_metadata("mlp", headers=headers)
            result = infer(client, module, "mlp", {"x": X}, {"x": "FP32"}, headers=headers)
            np.testing.assert_allclose(result.as_numpy("logits"), expected(), rtol=1e-5)
    finally:
        http_client.close()
        grpc_client.close()
    status, reply = rest_infer(row["http"], token)
    assert status == 200, reply
    np.testing.assert_allclose(np.array(reply["outputs"][0]["data"]).reshape(2, 10), expected(), rtol=1e-5)


def test_tokens_are_added_and_revoked_without_a_restart(daemon, token_file):
    row = gateway_row(daemon)
    pid = row["pid"]
    old = first_token(token_file)
    added = new_token(token_file, "a second caller")
    poll_until(lambda: rest_infer(row["http"], added)[0] == 200, 10, message="the added token accepted")

    # Revoke the first: its line goes, the file is replaced (a new inode, as editors do).
    text = "\n".join(line for line in token_file.read_text().splitlines() if line != old) + "\n"
    replacement = token_file.with_suffix(".new")
    replacement.write_text(text)
    os.chmod(replacement, 0o600)
    os.replace(replacement, token_file)
    poll_until(lambda: rest_infer(row["http"], old)[0] == 401, 10, message="the revoked token refused")
    assert rest_infer(row["http"], added)[0] == 200

    # A file others may read has leaked: nobody is let in until it is private again.
    os.chmod(token_file, 0o644)
    try:
        poll_until(lambda: rest_infer(row["http"], added)[0] == 401, 10,
                   message="every token refused while the file is world-readable")
        grpc = grpcclient.InferenceServerClient(row["grpc"])
        assert grpc_refusal(lambda: grpc.get_model_metadata(
            "mlp", headers={"authorization": f"Bearer {added}"})) == "StatusCode.UNAUTHENTICATED"
        grpc.close()
    finally:
        os.chmod(token_file, 0o600)
    poll_until(lambda: rest_infer(row["http"], added)[0] == 200, 10, message="the token accepted again")
    assert gateway_row(daemon)["pid"] == pid  # all of it without a restart
    assert "allows nobody until it is fixed" in daemon.log()

    # Put the first token back for the other tests of the module.
    with open(token_file, "a") as file:
        file.write(old + "\n")
    poll_until(lambda: rest_infer(row["http"], old)[0] == 200, 10, message="the first token back")


@pytest.mark.parametrize("content,mode,problem", [
    ("0123456789abcdef0123\n", 0o644, "other users may read it"),
    ("0123456789abcdef0123\n", 0o620, "its group may change it"),
    ("# nobody yet\n\n", 0o600, "holds no token"),
    ("short\n", 0o600, "line 1: a token is at least 16"),
])
def test_a_token_file_that_cannot_be_trusted_stops_the_daemon_at_start(tmp_path, content, mode,
                                                                         problem):
    path = tmp_path / "tokens"
    path.write_text(content)
    os.chmod(path, mode)
    with gateway_daemon([mlp_model("mlp", workers=1)], {"http": "127.0.0.1:0",
                                                        "token_file": str(path)}) as instance:
        code = instance.process.wait(60)
        log = instance.log()
    assert code == 1, log
    assert f"[gateway] token_file {path}" in log and problem in log, log
    assert "READY" not in log  # refused before any worker was spawned


# -- the gatekeeper's clock and parsing (unit) -----------------------------------------------------


def test_the_gatekeeper_looks_at_the_file_at_most_once_a_second(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("a" * 16 + "\n")
    os.chmod(path, 0o600)
    now = [100.0]
    gate = access.Gatekeeper(path, clock=lambda: now[0])
    assert gate.allows("Bearer " + "a" * 16) and gate.allows("bearer  " + "a" * 16 + " ")
    for wrong in (None, "", "a" * 16, "Basic " + "a" * 16, "Bearer", "Bearer " + "a" * 15, "Bearer é"):
        assert not gate.allows(wrong), wrong
    path.write_text("b" * 16 + "\n")
    os.chmod(path, 0o600)
    now[0] += access.RECHECK_S / 2
    assert gate.allows("Bearer " + "a" * 16)  # not looked at yet
    now[0] += access.RECHECK_S / 2
    assert gate.allows("Bearer " + "b" * 16) and not gate.allows("Bearer " + "a" * 16)
    path.unlink()
    now[0] += access.RECHECK_S
    assert not gate.allows("Bearer " + "b" * 16)  # a lost file allows nobody


# -- unix sockets: the file system decides -------------------------------------------------------


def _python_for_others() -> str:
    from tests.test_privsep import _python_for_others as find

    return find()


# Run as another user: connect to the REST socket and ask for readiness, then to the gRPC one.
KNOCK = r"""
import json, socket, sys
found = {}
for kind, name in zip(("http", "grpc"), sys.argv[1:]):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(name)
        found[kind] = "connected"
        if kind == "http":
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
            found[kind] = sock.recv(64).split(b"\r\n")[0].decode()
    except OSError as exc:
        found[kind] = type(exc).__name__
    finally:
        sock.close()
print(json.dumps(found))
"""


def _knock(user: str, group: str, http_path: Path, grpc_path: Path) -> dict:
    done = subprocess.run(["setpriv", "--reuid", user, "--regid", group, "--init-groups",
                           _python_for_others(), "-I", "-S", "-c", KNOCK, str(http_path),
                           str(grpc_path)],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _unix_get(path: Path, target: str) -> tuple[int, dict]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    connection = http.client.HTTPConnection("gateway", timeout=30)
    connection.sock = sock
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="creates users and a group: needs root")
@pytest.mark.skipif(shutil.which("setpriv") is None or shutil.which("useradd") is None,
                    reason="needs setpriv and useradd")
def test_unix_socket_listeners_let_in_the_clients_group_and_nobody_else():
    with temporary_user("mwm") as (member, clients), temporary_user("mwo") as (outsider, others):
        # A directory anyone may enter: the sockets' own modes decide.
        sockets = Path(tempfile.mkdtemp(prefix="mw-", dir="/tmp")) / "gw"
        sockets.mkdir()
        os.chmod(sockets.parent, 0o755)
        os.chmod(sockets, 0o755)
        http_path, grpc_path = sockets / "http.sock", sockets / "grpc.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(grpc_path))  # bound, never listening: a socket left by a dead gateway
        stale.close()
        try:
            with gateway_daemon(MODELS, {"http": f"unix:{http_path}", "grpc": f"unix:{grpc_path}"},
                                shm_group=clients) as daemon:
                daemon.wait_ready()
                row = gateway_row(daemon)
                assert (row["http"], row["grpc"]) == (f"unix:{http_path}", f"unix:{grpc_path}")
                gid = grp.getgrnam(clients).gr_gid
                for path in (http_path, grpc_path):
                    info = os.lstat(path)
                    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660, path
                    assert info.st_gid == gid, path

                assert _knock(member, clients, http_path, grpc_path) == {
                    "http": "HTTP/1.1 200 OK", "grpc": "connected"}
                assert _knock(outsider, others, http_path, grpc_path) == {
                    "http": "PermissionError", "grpc": "PermissionError"}

                # The daemon's user serves over both, with Triton's gRPC client unchanged.
                assert _unix_get(http_path, "/v2/models/mlp")[0] == 200
                client = grpcclient.InferenceServerClient(f"unix:{grpc_path}")
                result = infer(client, grpcclient, "mlp", {"x": X}, {"x": "FP32"})
                np.testing.assert_allclose(result.as_numpy("logits"), expected(), rtol=1e-5)
                client.close()

                # Killed, the gateway leaves its sockets behind; the next one replaces them.
                pid = row["pid"]
                os.kill(pid, signal.SIGKILL)
                poll_until(lambda: not alive(pid), 10, message="the gateway gone")
                gateway_row(daemon, pid_not=pid)
                assert _unix_get(http_path, "/v2/health/ready") == (200, {"ready": True})
                assert stat.S_IMODE(os.lstat(http_path).st_mode) == 0o660
            assert not http_path.exists() and not grpc_path.exists()  # removed at a clean stop
        finally:
            shutil.rmtree(sockets.parent, ignore_errors=True)


def test_a_unix_listener_is_private_and_never_replaces_a_file_or_a_live_socket():
    directory = Path(tempfile.mkdtemp(prefix="mw-", dir="/tmp")) / "gw"
    directory.mkdir()
    squatted, live, fresh = directory / "file.sock", directory / "live.sock", directory / "new.sock"
    squatted.write_text("not a socket\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live))
    listener.listen(1)
    try:
        for address, problem in ((f"unix:{squatted}", "something that is not a socket is there"),
                                 (f"unix:{live}", "another process listens there")):
            with gateway_daemon(MODELS, {"http": address}) as daemon:
                daemon.wait_ready()
                poll_until(lambda: problem in daemon.log(), 60, message=problem)
                assert daemon.status()["gateway"]["state"] != "READY"
            assert squatted.read_text() == "not a socket\n"
        assert stat.S_ISSOCK(os.lstat(live).st_mode)  # still there, still the listener's
        # No shm_group: the daemon's user alone, from the moment it is bound.
        fresh_grpc = directory / "new-grpc.sock"
        with gateway_daemon(MODELS, {"http": f"unix:{fresh}", "grpc": f"unix:{fresh_grpc}"}) as daemon:
            daemon.wait_ready()
            gateway_row(daemon)
            assert [stat.S_IMODE(os.lstat(path).st_mode) for path in (fresh, fresh_grpc)] == [0o600] * 2
            assert _unix_get(fresh, "/v2/health/live") == (200, {"live": True})
    finally:
        listener.close()
        shutil.rmtree(directory.parent, ignore_errors=True)


def test_a_unix_listener_address_is_checked_in_the_configuration():
    from modelwarden.shared.config import GatewayConfig

    assert GatewayConfig(http="unix:/run/mw/gw.sock").http == "unix:/run/mw/gw.sock"
    assert GatewayConfig(grpc="unix:/run/mw/gw.sock", http="0.0.0.0:8000", allow_public=True)
    for bad, why in (("unix:relative.sock", "unix:/ABSOLUTE/PATH"),
                     ("unix-abstract:gw", "an abstract socket has no file mode"),
                     ("unix:/" + "x" * 120, "at most 107 bytes")):
        with pytest.raises(ValueError, match=why):
            GatewayConfig(http=bad)
    with pytest.raises(ValueError, match="give each its own address"):
        GatewayConfig(http="unix:/run/gw.sock", grpc="unix:/run/gw.sock")
    with pytest.raises(ValueError, match="reachable from other hosts"):
        GatewayConfig(http="0.0.0.0:8000")


# -- TLS ------------------------------------------------------------------------------------------


def self_signed(directory: Path, name: str = "gateway") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (0600), made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    os.chmod(key, 0o600)
    return cert, key


def test_tls_carries_tritonclient_and_plaintext_gets_nothing(tmp_path, token_file):
    import ssl

    cert, key = self_signed(tmp_path)
    token = first_token(token_file)
    with gateway_daemon(MODELS, {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "tls_cert": str(cert),
                                 "tls_key": str(key), "token_file": str(token_file),
                                 "read_timeout": 2.0}) as daemon:
        daemon.wait_ready()
        row = gateway_row(daemon)
        host, port = row["http"].rsplit(":", 1)
        grpc_host, grpc_port = row["grpc"].rsplit(":", 1)

        # A connection that never starts its handshake is cut after read_timeout, not held.
        for address in ((host, int(port)), (grpc_host, int(grpc_port))):
            with socket.create_connection(address) as silent:
                took = _closed_within(silent, 15)
                assert took is not None and took < 10, (address, took)

        # The REST port speaks TLS with our certificate, and carries Triton's client.
        context = ssl.create_default_context(cafile=str(cert))
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                assert dict(item[0] for item in tls.getpeercert()["subject"])["commonName"] == "localhost"
        client = httpclient.InferenceServerClient(row["http"], ssl=True,
                                                  ssl_options={"ca_certs": str(cert)})
        result = infer(client, httpclient, "mlp", {"x": X}, {"x": "FP32"},
                       headers={"Authorization": f"Bearer {token}"})
        np.testing.assert_allclose(result.as_numpy("logits"), expected(), rtol=1e-5)
        client.close()
        grpc_client = grpcclient.InferenceServerClient(row["grpc"], ssl=True,
                                                       root_certificates=str(cert))
        result = infer(grpc_client, grpcclient, "mlp", {"x": X}, {"x": "FP32"},
                       headers={"authorization": f"Bearer {token}"})
        np.testing.assert_allclose(result.as_numpy("logits"), expected(), rtol=1e-5)
        grpc_client.close()

        # Plaintext gets no answer on either port; the gateway serves on.
        with pytest.raises((http.client.HTTPException, OSError)):
            rest(row["http"], "GET", "/v2/health/live")
        plain = grpcclient.InferenceServerClient(row["grpc"])
        assert grpc_refusal(lambda: plain.is_server_live()) == "StatusCode.UNAVAILABLE"
        plain.close()
        assert daemon.status()["gateway"]["restarts"] == 0
        assert daemon.status()["gateway"]["access"] == ["tls", "tokens"]
        log = daemon.log()
        assert "(TLS)" in log
        assert "Handshake failed" not in log  # grpc's INFO line for each: a peer could fill the log


@pytest.mark.parametrize("problem", ["key readable by others", "key of another certificate"])
def test_a_tls_key_that_cannot_be_trusted_or_used_stops_the_daemon_at_start(tmp_path, problem):
    cert, key = self_signed(tmp_path)
    if problem == "key readable by others":
        os.chmod(key, 0o644)
        expected_text = f"[gateway] tls_key {key} has mode 0644"
    else:
        _, key = self_signed(tmp_path, "other")
        expected_text = f"[gateway] tls_cert {cert} with tls_key {key}"
    with gateway_daemon([mlp_model("mlp", workers=1)], {"http": "127.0.0.1:0", "tls_cert": str(cert),
                                                        "tls_key": str(key)}) as instance:
        code = instance.process.wait(60)
        log = instance.log()
    assert code == 1 and expected_text in log, log
    assert "READY" not in log


def test_a_public_address_needs_tls_and_tokens_or_an_explicit_choice(tmp_path):
    from modelwarden.shared.config import GatewayConfig

    files = {"tls_cert": tmp_path / "c", "tls_key": tmp_path / "k", "token_file": tmp_path / "t"}
    assert GatewayConfig(http="0.0.0.0:8000", grpc="[::]:8001", **files)
    for missing in files:
        partial = {key: value for key, value in files.items() if key != missing}
        with pytest.raises(ValueError, match="go together" if missing.startswith("tls") else
                           "reachable from other hosts"):
            GatewayConfig(http="0.0.0.0:8000", **partial)
    assert GatewayConfig(http="0.0.0.0:8000", allow_public=True)


# -- connections that hold descriptors without calling ---------------------------------------------


def _closed_within(sock: socket.socket, timeout: float, trickle: bytes | None = None) -> float | None:
    """Seconds until the peer closes ``sock`` (None if it is still open after ``timeout``),
    sending ``trickle`` every quarter second meanwhile if given."""
    import time

    started = time.monotonic()
    sock.settimeout(0.25)
    while time.monotonic() - started < timeout:
        try:
            if trickle is not None:
                sock.sendall(trickle)
            while sock.recv(4096):  # what the server says before it closes (gRPC: SETTINGS)
                pass
            return time.monotonic() - started
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
        except socket.timeout:
            continue
    return None


SLOW_MODEL = {"name": "slow", "source": "python:tests.faulty:make_echo",
              "kwargs": {"copy": True, "delay": 3.0}, "workers": 1, "cores_per_worker": 1,
              "threads": 1, "warmup": 0}


def test_connections_that_say_nothing_are_cut_and_a_flood_is_capped():
    read_timeout = 2.0
    with gateway_daemon(MODELS + [SLOW_MODEL], {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0",
                                                "max_connections": 4,
                                                "read_timeout": read_timeout}) as daemon:
        daemon.wait_ready()
        row = gateway_row(daemon)
        host, port = row["http"].rsplit(":", 1)
        rest_address = (host, int(port))
        grpc_host, grpc_port = row["grpc"].rsplit(":", 1)

        # REST: four connections that say nothing fill the cap; a fifth is closed at once.
        idle = [socket.create_connection(rest_address) for _ in range(4)]
        extra = socket.create_connection(rest_address)
        took = _closed_within(extra, 10)
        assert took is not None and took < read_timeout * 0.75, took
        # The four are cut after read_timeout; so is one that trickles its headers.
        trickler = socket.create_connection(rest_address)
        trickler.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: gw\r\n")
        for sock in idle:
            assert _closed_within(sock, 10) is not None
        took = _closed_within(trickler, 10, trickle=b"X-Pad: 1\r\n")
        assert took is not None and took < read_timeout * 3, took
        for sock in idle + [extra, trickler]:
            sock.close()
        assert ("gateway: 1 HTTP connection(s) closed at once (max_connections 4 reached) from "
                "peer:127.0.0.1 in the last minute") in daemon.log()
        # A call whose model takes longer than read_timeout is not cut: only reading is timed.
        status, reply = rest(row["http"], "POST", "/v2/models/slow/infer", body=json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [7.0]}]}).encode())[:2]
        assert status == 200 and reply["outputs"][0]["data"] == [7.0], reply

        # gRPC: the same cap and the handshake's deadline, grpc's own options.
        idle = [socket.create_connection((grpc_host, int(grpc_port))) for _ in range(4)]
        client = grpcclient.InferenceServerClient(row["grpc"])
        assert grpc_refusal(lambda: client.is_server_live(client_timeout=5)) == "StatusCode.UNAVAILABLE"
        for sock in idle:
            assert _closed_within(sock, 10) is not None
            sock.close()
        poll_until(lambda: grpcclient.InferenceServerClient(row["grpc"]).is_server_live(), 15,
                   message="gRPC serving once the idle connections are gone")
        assert rest(row["http"], "GET", "/v2/health/live")[:2] == (200, {"live": True})
        assert daemon.status()["gateway"]["restarts"] == 0


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_perf_analyzer_measures_a_gateway_that_asks_for_tokens(daemon, token_file, kind):
    import re

    from tests.test_gateway import perf_analyzer_command

    command, env = perf_analyzer_command()
    command += ["-m", "mlp", "-i", kind, "-u", gateway_row(daemon)[kind], "--shape", "x:1,64",
                "--concurrency-range", "1", "--measurement-mode", "count_windows",
                "--measurement-request-count", "50", "--stability-percentage", "100",
                "--max-trials", "3"]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0
    assert "UNAUTHENTICATED" in refused.stdout + refused.stderr
    before = mlp_requests(daemon)
    done = subprocess.run(command + ["-H", f"authorization: Bearer {first_token(token_file)}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    counted = sum(int(n) for n in re.findall(r"Request count: (\d+)", done.stdout))
    assert counted >= 50 and mlp_requests(daemon) - before >= counted, done.stdout


def client_certificate(directory: Path, name: str, ca: tuple[Path, Path] | None) -> tuple[Path, Path]:
    """A client certificate signed by ``ca`` (certificate, key), or self-signed if None."""
    if ca is None:
        return self_signed(directory, name)
    cert, key, request = directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    subprocess.run(["openssl", "req", *ec, "-subj", f"/CN={name}", "-keyout", str(key),
                    "-out", str(request)], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey",
                    str(ca[1]), "-CAcreateserial", "-days", "2", "-out", str(cert)],
                   check=True, capture_output=True, cwd=directory)
    return cert, key


def test_with_tls_client_ca_only_callers_with_a_certificate_it_signed_get_in(tmp_path):
    cert, key = self_signed(tmp_path)
    authority = self_signed(tmp_path, "clients-ca")
    alice = client_certificate(tmp_path, "alice", authority)
    mallory = client_certificate(tmp_path, "mallory", None)  # a certificate, but not the CA's
    with gateway_daemon(MODELS, {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "tls_cert": str(cert),
                                 "tls_key": str(key), "tls_client_ca": str(authority[0])}) as daemon:
        daemon.wait_ready()
        row = gateway_row(daemon)

        def rest_as(identity):
            options = {"ca_certs": str(cert)}
            if identity is not None:
                options.update(certfile=str(identity[0]), keyfile=str(identity[1]))
            client = httpclient.InferenceServerClient(row["http"], ssl=True, ssl_options=options)
            try:
                return infer(client, httpclient, "mlp", {"x": X}, {"x": "FP32"}).as_numpy("logits")
            finally:
                client.close()

        def grpc_as(identity):
            client = grpcclient.InferenceServerClient(
                row["grpc"], ssl=True, root_certificates=str(cert),
                **({"private_key": str(identity[1]), "certificate_chain": str(identity[0])}
                   if identity is not None else {}))
            try:
                return infer(client, grpcclient, "mlp", {"x": X}, {"x": "FP32"}).as_numpy("logits")
            finally:
                client.close()

        for call in (rest_as, grpc_as):
            np.testing.assert_allclose(call(alice), expected(), rtol=1e-5)
            for stranger in (None, mallory):
                # ssl.SSLError is an OSError; geventhttpclient says "connection closed"
                with pytest.raises((InferenceServerException, OSError, http.client.HTTPException)):
                    call(stranger)
        before = mlp_requests(daemon)
        np.testing.assert_allclose(grpc_as(alice), expected(), rtol=1e-5)
        assert mlp_requests(daemon) == before + 1  # the strangers' calls never reached a worker
        assert daemon.status()["gateway"]["restarts"] == 0
        assert daemon.status()["gateway"]["access"] == ["tls", "client-certificates"]

    from modelwarden.shared.config import GatewayConfig

    assert GatewayConfig(http="0.0.0.0:8000", tls_cert=cert, tls_key=key, tls_client_ca=authority[0])
    with pytest.raises(ValueError, match="tls_client_ca needs tls_cert"):
        GatewayConfig(http="127.0.0.1:8000", tls_client_ca=authority[0])


def _rest_trusts(address: str, authority: Path) -> bool:
    """Whether a TLS handshake with the REST port succeeds trusting only ``authority``."""
    import ssl

    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(authority))
    try:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="localhost"):
                return True
    except ssl.SSLError:
        return False


def _grpc_trusts(address: str, authority: Path) -> bool:
    client = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(authority))
    try:
        return grpc_refusal(lambda: client.is_server_live(client_timeout=10)) is None
    finally:
        client.close()


def test_a_renewed_certificate_is_served_from_the_next_connection_without_a_restart(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    old_cert, old_key = self_signed(tmp_path, "old")
    new_cert, new_key = self_signed(tmp_path, "new")
    stray_key = self_signed(tmp_path, "stray")[1]
    cert, key = live / "gateway.crt", live / "gateway.key"
    shutil.copy(old_cert, cert)
    shutil.copy(old_key, key)
    os.chmod(key, 0o600)
    with gateway_daemon(MODELS, {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "tls_cert": str(cert),
                                 "tls_key": str(key)}) as daemon:
        daemon.wait_ready()
        row = gateway_row(daemon)
        assert _rest_trusts(row["http"], old_cert) and not _rest_trusts(row["http"], new_cert)
        assert _grpc_trusts(row["grpc"], old_cert)

        # A key that does not match the certificate (a renewal caught half-way): the old pair
        # stays in use, and the log says why.
        # The files are looked at as connections come: keep connecting until both have looked.
        shutil.copy(stray_key, key)
        poll_until(lambda: (_rest_trusts(row["http"], old_cert) and _grpc_trusts(row["grpc"], old_cert)
                            and daemon.log().count("the gateway keeps its previous TLS certificate") == 2),
                   15, interval=0.2, message="the mismatched pair refused by both listeners")

        # The renewal completes: each listener serves the new certificate from its next
        # connection on, with the same gateway process.
        shutil.copy(new_key, key)
        shutil.copy(new_cert, cert)
        poll_until(lambda: _rest_trusts(row["http"], new_cert), 15, interval=0.2,
                   message="REST serving the new certificate")
        poll_until(lambda: _grpc_trusts(row["grpc"], new_cert), 15, interval=0.2,
                   message="gRPC serving the new certificate")
        assert not _rest_trusts(row["http"], old_cert) and not _grpc_trusts(row["grpc"], old_cert)
        assert gateway_row(daemon)["pid"] == row["pid"]


def test_a_renewed_client_ca_takes_effect_from_the_next_connection_without_a_restart(tmp_path):
    cert, key = self_signed(tmp_path)
    first_ca, second_ca = self_signed(tmp_path, "first-ca"), self_signed(tmp_path, "second-ca")
    first, second = client_certificate(tmp_path, "first", first_ca), client_certificate(tmp_path, "second", second_ca)
    live_ca = tmp_path / "clients-ca.crt"
    shutil.copy(first_ca[0], live_ca)
    with gateway_daemon(MODELS, {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "tls_cert": str(cert),
                                 "tls_key": str(key), "tls_client_ca": str(live_ca)}) as daemon:
        daemon.wait_ready()
        row = gateway_row(daemon)

        def served(identity) -> dict:
            found = {}
            rest_client = httpclient.InferenceServerClient(row["http"], ssl=True, ssl_options={
                "ca_certs": str(cert), "certfile": str(identity[0]), "keyfile": str(identity[1])})
            grpc_client = grpcclient.InferenceServerClient(
                row["grpc"], ssl=True, root_certificates=str(cert), private_key=str(identity[1]),
                certificate_chain=str(identity[0]))
            for kind, client in (("http", rest_client), ("grpc", grpc_client)):
                try:
                    found[kind] = bool(client.is_server_live())
                except (InferenceServerException, OSError, http.client.HTTPException):
                    found[kind] = False
                finally:
                    client.close()
            return found

        assert served(first) == {"http": True, "grpc": True}
        assert served(second) == {"http": False, "grpc": False}
        shutil.copy(second_ca[0], live_ca)  # the clients' CA is replaced
        poll_until(lambda: served(second) == {"http": True, "grpc": True}, 15, interval=0.2,
                   message="the new CA's client served on both listeners")
        assert served(first) == {"http": False, "grpc": False}
        assert gateway_row(daemon)["pid"] == row["pid"]


# -- each caller's share -------------------------------------------------------------------------

ECHO_SLOW = {"name": "echo", "source": "python:tests.faulty:make_echo",
             "kwargs": {"copy": True, "delay": 0.4}, "workers": 1, "cores_per_worker": 1,
             "threads": 1, "warmup": 0}


def test_a_token_that_floods_past_its_share_is_refused_while_another_is_served(tmp_path):
    tokens = tmp_path / "tokens"
    flooder, other = new_token(tokens, "flooder"), new_token(tokens, "other")
    with gateway_daemon([ECHO_SLOW], {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0",
                                      "token_file": str(tokens), "max_requests_in_flight": 8,
                                      "identity_share": 0.25}) as instance:
        instance.wait_ready()
        row = gateway_row(instance)
        body = json.dumps({"inputs": [{"name": "in", "datatype": "FP32", "shape": [1],
                                       "data": [3.0]}]}).encode()

        def call(token):
            return rest(row["http"], "POST", "/v2/models/echo/infer", token, body)[:2]

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            flood = [pool.submit(call, flooder) for _ in range(8)]
            served = [pool.submit(call, other) for _ in range(2)]
            flood, served = [f.result() for f in flood], [f.result() for f in served]
        ok = [reply for status, reply in flood if status == 200]
        refused = [reply for status, reply in flood if status == 429]
        assert len(ok) + len(refused) == len(flood)  # nothing else: every call typed
        assert 1 <= len(ok) <= 2 + 2 and len(refused) >= 4, flood  # 2 at a time, 0.4 s each
        flooder_id = access.token_id(hashlib.sha256(flooder.encode()).digest())
        assert refused[0]["error"].startswith(f"OVERLOADED: {flooder_id} has 2 calls in flight")
        assert "identity_share 0.25 of max_requests_in_flight 8" in refused[0]["error"]
        assert flooder not in refused[0]["error"]
        assert [status for status, _ in served] == [200, 200], served
        assert all(reply["outputs"][0]["data"] == [3.0] for _, reply in served + [(200, r) for r in ok])
        # What each caller holds shows in status, by the token's id, never the token.
        stop = threading.Event()

        def keep_calling():
            while not stop.is_set():
                call(flooder)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            callers = [pool.submit(keep_calling) for _ in range(2)]
            try:
                seen = poll_until(lambda: [caller for caller in gateway_row(instance)["identities"]
                                           if caller["identity"] == flooder_id and caller["requests"]],
                                  20, message="the flooding token's calls shown in status")
            finally:
                stop.set()
                for caller in callers:
                    caller.result()
        assert seen[0]["requests"] <= 2
        assert flooder not in json.dumps(instance.status())
        # gRPC: the same share, RESOURCE_EXHAUSTED
        client = grpcclient.InferenceServerClient(row["grpc"])
        value = np.ones((1,), dtype=np.float32)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(lambda _: grpc_refusal(lambda: infer(
                client, grpcclient, "echo", {"in": value}, {"in": "FP32"},
                headers={"authorization": f"Bearer {flooder}"})), range(6)))
        assert outcomes.count("StatusCode.RESOURCE_EXHAUSTED") >= 2, outcomes
        assert set(outcomes) <= {None, "StatusCode.RESOURCE_EXHAUSTED"}, outcomes
        assert flooder not in instance.log()
