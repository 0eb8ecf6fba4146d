"""Unit tests of supervisor/fleet/reload.py (what a new configuration changes, per model) and of
supervisor/fleet/versions.py (model versions computed without importing anything)."""

from __future__ import annotations

import os
import sys

import pytest

from modelwarden.shared.config import ConfigError, ModelConfig, Settings
from modelwarden.supervisor.fleet import reload
from modelwarden.supervisor.fleet.placement import plan
from modelwarden.supervisor.fleet.versions import VersionBook, find_module_file


def model(name: str, **fields) -> dict:
    return {"name": name, "source": "python:pkg.mod:build", "warmup": 0, **fields}


def settings(*models: dict, **daemon) -> Settings:
    return Settings(models=list(models), daemon={"allow_oversubscription": True, **daemon})


def diff(old: Settings, new: Settings, versions: dict | None = None) -> reload.ReloadPlan:
    cores = list(range(8))
    running = plan(old, cores)
    return reload.diff(old, new, running, plan(new, cores, keep=running),
                       lambda config: config.version or "v0",
                       versions or {m.name: {"v0"} for m in old.models})


def test_added_removed_and_unchanged_models():
    result = diff(settings(model("a"), model("b")), settings(model("a"), model("c")))
    assert [config.name for config in result.added] == ["c"]
    assert result.removed == ["b"]
    assert result.kept["a"].reasons == [] and not result.kept["a"].roll
    assert result.summary() == ["c: added (1 worker(s))", "b: removed"]


def test_a_worker_count_change_scales_without_rolling_the_kept_slots():
    result = diff(settings(model("a", workers=2), model("b")), settings(model("a", workers=3), model("b")))
    change = result.kept["a"]
    assert change.reasons == ["workers 2 -> 3"] and not change.roll and len(change.placements) == 3
    assert result.kept["b"].reasons == []  # b keeps its core: nothing moved


@pytest.mark.parametrize("field, value", [
    ("source", "python:pkg.other:build"), ("kwargs", {"scale": 2}), ("version", "v2"),
    ("threads", 1), ("cuda_fallback_to_cpu", True), ("reject_nonfinite", True),
    ("batching", {"dim": 1}), ("probe", {"seed": 7}),
])
def test_what_a_worker_is_built_from_rolls_it(field, value):
    change = diff(settings(model("a")), settings(model("a", **{field: value}))).kept["a"]
    assert change.roll, change
    assert change.reasons[0].startswith("rolling (") and field in change.reasons[0]


@pytest.mark.parametrize("field, value", [
    ("timeout", 5.0), ("max_queue", 3), ("max_inflight", 3), ("fatal_retry", 0),
    ("batching", {"max_size": 8}), ("probe", {"interval": 1.0, "max_replacements": 1}),
])
def test_supervisor_policy_applies_in_place(field, value):
    change = diff(settings(model("a")), settings(model("a", **{field: value}))).kept["a"]
    assert not change.roll and change.reasons[0].startswith("applied in place: "), change


def test_a_new_model_file_under_the_same_configuration_rolls_by_version():
    config = settings(model("a"))
    change = diff(config, config, versions={"a": {"old-hash"}}).kept["a"]
    assert change.reasons == ["rolling (version old-hash -> v0)"]


def test_daemon_keys_bound_at_start_are_refused_by_name():
    old = settings(model("a"))
    reload.check_daemon_unchanged(old, settings(model("a"), graceful_timeout=5.0))
    with pytest.raises(ConfigError) as refused:
        reload.check_daemon_unchanged(old, settings(model("a"), shm=False, log_level="DEBUG"))
    assert refused.value.key == "daemon.log_level, daemon.shm"
    assert "applies only when the daemon starts" in refused.value.problem


def test_every_model_field_is_either_policy_or_part_of_what_a_worker_is():
    # A new ModelConfig field lands on the worker side unless listed as policy: rolling is the
    # safe default. This pins the policy list to real fields.
    assert reload.POLICY_FIELDS <= set(ModelConfig.model_fields)
    for table, keys in reload.POLICY_SUBFIELDS.items():
        assert keys <= set(ModelConfig.model_fields[table].annotation.model_fields)


# -- versions -----------------------------------------------------------------------------------


def test_a_configured_version_wins(tmp_path):
    book = VersionBook(tmp_path, [])
    assert book.of(ModelConfig(**model("a", version="2024-06-01"))) == "2024-06-01"


def test_a_model_file_version_follows_its_bytes_and_the_kwargs(tmp_path):
    weights = tmp_path / "m.pt"
    weights.write_bytes(b"weights one")
    book = VersionBook(tmp_path, [])
    config = ModelConfig(name="a", source="torchscript:m.pt", warmup=0)
    first = book.of(config)
    assert len(first) == 12 and book.of(config) == first
    weights.write_bytes(b"weights two")
    os.utime(weights, ns=(1, 1))  # a new mtime: the digest is computed again
    assert book.of(config) != first
    assert book.of(config.model_copy(update={"kwargs": {"x": 1}})) != book.of(config)


def test_a_python_source_version_hashes_the_module_file_found_without_importing(tmp_path):
    package = tmp_path / "pkgx"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (package / "models.py").write_text("def build(): ...\n")
    assert find_module_file("pkgx.models", [str(tmp_path)]) == package / "models.py"
    assert find_module_file("pkgx", [str(tmp_path)]) == package / "__init__.py"
    book = VersionBook(tmp_path, [str(tmp_path)])
    config = ModelConfig(name="a", source="python:pkgx.models:build", warmup=0)
    first = book.of(config)
    (package / "models.py").write_text("def build(): return 2\n")
    os.utime(package / "models.py", ns=(2, 2))
    assert book.of(config) != first
    assert "pkgx" not in sys.modules


def test_declared_outputs_apply_in_place_and_the_gateway_section_needs_a_restart():
    outputs = [{"name": "y", "dtype": "float32", "shape": [-1, 1]}]
    change = diff(settings(model("a")), settings(model("a", outputs=outputs))).kept["a"]
    assert not change.roll, change
    old = settings(model("a"))
    gatewayed = Settings(models=[model("a")], daemon={"allow_oversubscription": True},
                         gateway={"http": "127.0.0.1:8000"})
    with pytest.raises(ConfigError) as refused:
        reload.check_daemon_unchanged(old, gatewayed)
    assert refused.value.key == "gateway"
