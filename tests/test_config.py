"""Configuration: the file, environment overrides, and clear errors (exit 2, one line, no
traceback) from the real command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modelwarden.shared.config import ConfigError, load_settings
from tests.helpers import ROOT, render_config, mlp_model


def write(tmp_path: Path, models: list[dict], daemon: dict | None = None) -> Path:
    path = tmp_path / "mw.toml"
    path.write_text(render_config(daemon or {"runtime_dir": str(tmp_path / "run")}, models))
    return path


def serve_check(path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    environment = {**os.environ, **(env or {})}
    environment.pop("MODELWARDEN_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "modelwarden", "serve", "--check", "--config", str(path)],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60)


def assert_config_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {result.stderr}"
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_example_config_is_valid():
    result = serve_check(ROOT / "examples" / "modelwarden.toml")
    assert result.returncode == 0, result.stderr
    assert "mlp#0: cpu[" in result.stdout and "mlp#1: cpu[" in result.stdout


def test_systemd_example_config_is_valid():
    result = serve_check(ROOT / "systemd" / "modelwarden.toml")
    assert result.returncode == 0, result.stderr
    assert "mlp#1: cpu[" in result.stdout


def test_systemd_unit_verifies():
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    result = subprocess.run(["systemd-analyze", "verify", str(ROOT / "systemd" / "modelwarden.service")],
                            capture_output=True, text=True, timeout=60)
    problems = [line for line in result.stderr.splitlines()
                if line.strip() and "is not executable" not in line and "/opt/modelwarden" not in line]
    assert not problems, problems


def test_oversubscription_is_an_error_naming_the_key(tmp_path):
    import os

    cores = len(os.sched_getaffinity(0))
    path = write(tmp_path, [mlp_model(workers=cores + 1)])
    assert_config_error(serve_check(path), "models[0]", "cores_per_worker", "allow_oversubscription")


def test_threads_above_cores_is_an_error(tmp_path):
    path = write(tmp_path, [mlp_model(workers=1, threads=2)])
    assert_config_error(serve_check(path), "models[0] (model 'mlp').threads", "never runs more threads")


def test_unknown_source_scheme(tmp_path):
    path = write(tmp_path, [mlp_model(source="onnx:model.onnx", workers=1)])
    assert_config_error(serve_check(path), "models[0].source", "unknown source scheme")


def test_missing_model_file(tmp_path):
    path = write(tmp_path, [mlp_model(source="torchscript:missing.pt", workers=1)])
    assert_config_error(serve_check(path), "models[0].source", "does not exist")


def test_unknown_key(tmp_path):
    path = write(tmp_path, [mlp_model(workers=1, wrokers=2)])
    assert_config_error(serve_check(path), "models[0].wrokers", "unknown key")


def test_bad_dtype_names_nested_key(tmp_path):
    model = mlp_model(workers=1, inputs=[{"name": "x", "dtype": "float33", "shape": [-1, 64]}])
    assert_config_error(serve_check(write(tmp_path, [model])), "models[0].inputs[0].dtype", "float33")


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[daemon\n")
    assert_config_error(serve_check(path), "not valid TOML")


def test_environment_overrides_by_model_name_and_index(tmp_path, monkeypatch):
    path = write(tmp_path, [mlp_model(workers=1), mlp_model(name="other", workers=1)])
    monkeypatch.setenv("MODELWARDEN_MODELS__other__WORKERS", "2")
    monkeypatch.setenv("MODELWARDEN_MODELS__0__TIMEOUT", "7.5")
    monkeypatch.setenv("MODELWARDEN_DAEMON__LOG_LEVEL", "DEBUG")
    settings = load_settings(path)
    assert settings.model("other").workers == 2
    assert settings.model("mlp").timeout == 7.5
    assert settings.daemon.log_level == "DEBUG"


def test_environment_names_the_config_file(tmp_path, monkeypatch):
    path = write(tmp_path, [mlp_model(workers=1)])
    monkeypatch.setenv("MODELWARDEN_CONFIG", str(path))
    settings = load_settings()
    assert settings.config_path == path.resolve()
    assert settings.frontends == [f"ipc://{tmp_path / 'run'}/frontend.sock",
                                  f"unix://{tmp_path / 'run'}/local.sock"]


def test_the_client_reads_the_frontends_the_daemon_validates_without_pydantic(tmp_path, monkeypatch):
    """client.default_endpoint reads MODELWARDEN_CONFIG through rawconfig (standard library): the
    same frontends the daemon's schema gives, for the default, a listed one and an override."""
    from modelwarden.shared.rawconfig import frontend_endpoints

    path = write(tmp_path, [mlp_model(workers=1)])
    assert frontend_endpoints(path) == load_settings(path).frontends
    listed = ["tcp://127.0.0.1:5555", f"ipc://{tmp_path}/other.sock"]
    monkeypatch.setenv("MODELWARDEN_DAEMON__FRONTEND", json.dumps(listed))
    assert frontend_endpoints(path) == load_settings(path).frontends == listed
    monkeypatch.setenv("MODELWARDEN_CONFIG", str(path))
    monkeypatch.delenv("MODELWARDEN_ENDPOINT", raising=False)
    script = ("import sys\nfrom modelwarden.client.client import default_endpoint\n"
              "print(default_endpoint(), 'pydantic' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.stdout.split() == [listed[1], "False"], done.stderr[-2000:]  # the ipc one first


def test_bad_environment_override_is_a_config_error(tmp_path, monkeypatch):
    path = write(tmp_path, [mlp_model(workers=1)])
    monkeypatch.setenv("MODELWARDEN_MODELS__nosuch__WORKERS", "2")
    with pytest.raises(ConfigError, match="models.nosuch"):
        load_settings(path)
    monkeypatch.delenv("MODELWARDEN_MODELS__nosuch__WORKERS")
    result = serve_check(path, {"MODELWARDEN_MODELS__mlp__WORKERS": "zero"})
    assert_config_error(result, "models[0]", "workers")


def test_warmup_needs_an_input_spec(tmp_path):
    model = mlp_model(workers=1)
    del model["inputs"]
    assert_config_error(serve_check(write(tmp_path, [model])), "models[0]", "warm-up needs")


def test_max_inflight_defaults_to_two_and_to_one_with_batching_unless_set(tmp_path):
    models = [mlp_model(name="plain", workers=1),
              mlp_model(name="batched", workers=1, batching={"max_size": 8}),
              mlp_model(name="set", workers=1, batching={"max_size": 8}, max_inflight=3)]
    settings = load_settings(write(tmp_path, models))
    assert [model.max_inflight for model in settings.models] == [2, 1, 3]


def test_inputs_may_be_str_or_bytes_elements(tmp_path):
    model = mlp_model(workers=1, inputs=[{"name": "texts", "dtype": "str", "shape": [-1]},
                                         {"name": "blob", "dtype": "bytes", "shape": []}])
    settings = load_settings(write(tmp_path, [model]))
    assert [spec.dtype for spec in settings.models[0].inputs] == ["str", "bytes"]
    model = mlp_model(workers=1, inputs=[{"name": "texts", "dtype": "string", "shape": [-1]}])
    with pytest.raises(ConfigError, match="str, bytes"):
        load_settings(write(tmp_path, [model]))


def _with_gateway(tmp_path: Path, section: str, **model) -> Path:
    path = write(tmp_path, [mlp_model(**model)])
    path.write_text(path.read_text() + "\n[gateway]\n" + section)
    return path


def test_the_gateway_section_and_declared_outputs_load(tmp_path):
    path = _with_gateway(tmp_path, 'http = "127.0.0.1:8000"\nmax_message_bytes = "64MiB"\n',
                         outputs=[{"name": "logits", "dtype": "float32", "shape": [-1, 10]}])
    settings = load_settings(path)
    assert settings.gateway.http == "127.0.0.1:8000" and settings.gateway.grpc is None
    assert settings.gateway.max_message_bytes == 64 * 1024**2
    assert settings.models[0].outputs[0].name == "logits"
    assert load_settings(write(tmp_path, [mlp_model()])).gateway is None


@pytest.mark.parametrize("section,fragment", [
    ('http = "0.0.0.0:8000"\n', "reachable from other hosts"),
    ('grpc = "10.1.2.3:8001"\n', "reachable from other hosts"),
    ("allow_public = true\n", "needs http"),
    ('http = "8000"\n', "not HOST:PORT"),
])
def test_a_bad_gateway_section_is_one_clear_line(tmp_path, section, fragment):
    assert_config_error(serve_check(_with_gateway(tmp_path, section)), "gateway", fragment)


def test_a_public_gateway_needs_allow_public(tmp_path):
    path = _with_gateway(tmp_path, 'http = "0.0.0.0:8000"\nallow_public = true\n')
    assert load_settings(path).gateway.http == "0.0.0.0:8000"
