"""Weights from a file (worker/weights.py): mapped copy-on-write and shared between workers through
the page cache (``weights = "mmap"``), or read privately (``"load"``, the default)."""

import hashlib
import os

import pytest
import torch

from modelwarden.examples import make_mlp
from modelwarden.client.client import Client
from modelwarden.shared.config import ConfigError, load_settings
from modelwarden.worker.weights import (MODES, WeightsError, assign_weights, read_state_dict,
                                        save_safetensors)
from tests.faulty import MARKER
from tests.helpers import Daemon, alive, poll_until

BIG = {"in_features": 1024, "hidden": 10000, "out_features": 10}  # 41 MB of float32 weights


def reference_model(**shape) -> torch.nn.Module:
    return make_mlp(**shape, seed=3)


def write_weights(path, **shape):
    save_safetensors(reference_model(**shape).state_dict(), path)
    return path


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mapping_of(pid: int, path) -> dict[str, int]:
    """Rss and Pss (kB), summed over every mapping of ``path`` in process ``pid``."""
    totals = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = fields[-1] == str(path)
            elif inside and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1])
    return totals


def mlp_from_file(name, path, weights="mmap", workers=2, **extra):
    model = {"name": name, "source": "python:modelwarden.examples:make_mlp",
             "kwargs": {**BIG, "empty": True}, "weights": weights, "weights_file": str(path),
             "workers": workers, "cores_per_worker": 1, "threads": 1, "warmup": 2,
             "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, BIG["in_features"]]}]}
    model.update(extra)
    return model


# -- in-process: the file formats and the copy-on-write contract ------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("mode", MODES)
def test_weights_from_a_file_give_the_saved_model(tmp_path, suffix, mode):
    saved = reference_model(in_features=16, hidden=32, out_features=4)
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        save_safetensors(saved.state_dict(), path)
    else:
        torch.save(saved.state_dict(), path)
    loaded = make_mlp(16, 32, 4, empty=True)
    assign_weights(loaded, read_state_dict(path, mode))
    x = torch.randn(5, 16)
    assert torch.equal(loaded(x), saved(x))


def test_a_write_to_mapped_weights_stays_private(tmp_path):
    path = write_weights(tmp_path / "w.safetensors", in_features=16, hidden=32, out_features=4)
    before = sha256(path)
    writer = read_state_dict(path, "mmap")
    writer["0.weight"].add_(1.0)
    other = read_state_dict(path, "mmap")
    assert torch.equal(other["0.weight"], reference_model(in_features=16, hidden=32,
                                                         out_features=4)[0].weight)
    assert sha256(path) == before


def test_a_model_left_without_weights_is_refused(tmp_path):
    path = tmp_path / "partial.safetensors"
    save_safetensors({"0.weight": torch.zeros(32, 16)}, path)
    with pytest.raises(RuntimeError, match="Missing key"):
        assign_weights(make_mlp(16, 32, 4, empty=True), read_state_dict(path, "mmap"))


@pytest.mark.parametrize("content, message", [
    (b"\x01", "too short"),
    ((1 << 40).to_bytes(8, "little") + b"{}", "header length"),
    ((2).to_bytes(8, "little") + b"[]", "not a map"),
    ((7).to_bytes(8, "little") + b'{"a":1}', "bad header entry"),
])
def test_a_corrupt_safetensors_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match=message):
        read_state_dict(path, "mmap")


def test_offsets_past_the_end_of_the_file_are_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    save_safetensors({"w": torch.zeros(4, 4)}, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(WeightsError, match="do not fit"):
        read_state_dict(path, "load")


@pytest.mark.parametrize("lines, message", [
    ('source = "python:a:b"\nweights = "mmap"', "needs a weights_file"),
    ('source = "torchscript:m.pt"\nweights_file = "w.pt"', "python: or export: source"),
    ('source = "python:a:b"\nweights = "shared"', "weights"),
])
def test_weights_settings_that_cannot_work_are_config_errors(tmp_path, lines, message):
    config = tmp_path / "c.toml"
    config.write_text(f'[[models]]\nname = "m"\nwarmup = 0\n{lines}\n')
    with pytest.raises(ConfigError, match=message):
        load_settings(config)


# -- the real daemon: two workers, one copy -------------------------------------------------


def test_two_workers_share_one_copy_of_mapped_weights(tmp_path):
    path = write_weights(tmp_path / "big.safetensors", **BIG)
    size_kb = path.stat().st_size // 1024
    with Daemon([mlp_from_file("big", path)]) as daemon:
        daemon.wait_ready()
        x = torch.randn(3, BIG["in_features"])
        with Client(daemon.endpoint) as client:
            # in flight together, so both workers answer (one at a time would reuse the warm one)
            answers = [future.result(60) for future in
                       [client.submit("big", x, details=True) for _ in range(8)]]
        assert {answer.worker for answer in answers} == {"big#0", "big#1"}
        expected = reference_model(**BIG)(x)
        for answer in answers:  # the same weights; sums of 10000 terms in another thread count
            assert torch.equal(answer.outputs, answers[0].outputs)
            torch.testing.assert_close(answer.outputs, expected, rtol=1e-4, atol=1e-3)
        for pid in daemon.worker_pids():
            mapped = mapping_of(pid, path)
            # each worker has every page of the file resident, and is charged about half of it
            assert mapped["Rss"] >= 0.95 * size_kb, mapped
            assert mapped["Pss"] <= 0.6 * mapped["Rss"], mapped


def test_a_worker_writing_to_mapped_weights_changes_only_itself_and_its_probe_catches_it(tmp_path):
    path = write_weights(tmp_path / "w.safetensors", in_features=64, hidden=256, out_features=10)
    before = sha256(path)
    model = mlp_from_file("writer", path, source="python:tests.faulty:make_weight_writer",
                          kwargs={"in_features": 64, "hidden": 256, "out_features": 10},
                          inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 64]}],
                          probe={"interval": 0.3, "failures": 1})
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        # the recorded golden: both workers probed healthy before anything writes
        poll_until(lambda: all(w["probe"]["ok"] for w in daemon.workers("writer")), 30,
                   message="a healthy probe of each worker")
        pids = {w["id"]: w["pid"] for w in daemon.workers("writer")}
        x = torch.randn(2, 64)
        expected = reference_model(in_features=64, hidden=256, out_features=10)(x)
        with Client(daemon.endpoint) as client:
            writer = client.infer("writer", torch.full((1, 64), MARKER), details=True).worker
            others = []
            def the_other_worker_answers():
                answer = client.infer("writer", x, details=True)
                if answer.worker != writer:
                    others.append(answer.outputs)
                return others
            poll_until(the_other_worker_answers, 30, message="an answer from the other worker")
        torch.testing.assert_close(others[0], expected)
        assert sha256(path) == before
        # the writer computes something else now: its probe fails and it is replaced
        poll_until(lambda: not alive(pids[writer]), 60, message="the writer replaced")
        other = next(name for name in pids if name != writer)
        assert daemon.workers("writer")  # the daemon serves on
        assert alive(pids[other]), "the other worker must not be replaced"
        assert os.path.exists(path)


def test_the_weights_file_is_part_of_the_derived_version(tmp_path):
    from modelwarden.shared.config import ModelConfig
    from modelwarden.supervisor.fleet.versions import VersionBook

    path = write_weights(tmp_path / "w.safetensors", in_features=16, hidden=32, out_features=4)
    model = ModelConfig(name="m", source="python:modelwarden.examples:make_mlp", warmup=0,
                        weights="mmap", weights_file="w.safetensors")
    book = VersionBook(tmp_path, [])
    first = book.of(model)
    save_safetensors(make_mlp(16, 32, 4, seed=4).state_dict(), tmp_path / "new.safetensors")
    (tmp_path / "new.safetensors").rename(path)  # new weights put in place
    assert book.of(model) != first
    assert book.of(model.model_copy(update={"weights_file": None})) != book.of(model)


def test_a_weights_file_inside_a_package_is_found_without_importing_it(tmp_path):
    import sys

    from modelwarden.shared.weightsfile import WeightsFileError, resolve_weights_file

    package = tmp_path / "shipsweights"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    found = resolve_weights_file("package:shipsweights/model/w.safetensors", tmp_path, [str(tmp_path)])
    assert found == package / "model" / "w.safetensors"
    assert "shipsweights" not in sys.modules
    assert resolve_weights_file("w.pt", tmp_path) == tmp_path / "w.pt"
    with pytest.raises(WeightsFileError, match="not installed"):
        resolve_weights_file("package:no_such_package_here/w.pt", tmp_path)


def test_a_weights_file_that_does_not_fit_the_model_is_a_load_error_in_status(tmp_path):
    path = write_weights(tmp_path / "small.safetensors", in_features=16, hidden=32, out_features=4)
    model = mlp_from_file("misfit", path, workers=1, max_start_failures=1, backoff_initial=0.05)
    with Daemon([model]) as daemon:
        worker = poll_until(lambda: next((w for w in daemon.workers("misfit") if w["state"] == "FATAL"),
                                         None), 60, message="the slot FATAL after a load error")
        assert "size mismatch" in worker["error"] and worker["last_exit"].startswith("exit 4"), worker


def test_an_exported_program_takes_its_weights_from_the_file(tmp_path):
    # torch.export's module keeps the original module's parameter names, so the file's
    # weights replace the ones exported with the program.
    exported = make_mlp(16, 32, 4, seed=1).eval()
    program = torch.export.export(exported, (torch.randn(2, 16),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, tmp_path / "m.pt2")
    write_weights(tmp_path / "w.safetensors", in_features=16, hidden=32, out_features=4)
    model = {"name": "exported", "source": f"export:{tmp_path / 'm.pt2'}", "weights": "mmap",
             "weights_file": str(tmp_path / "w.safetensors"), "workers": 1, "cores_per_worker": 1,
             "threads": 1, "warmup": 1, "inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 16]}]}
    x = torch.randn(5, 16)
    with Daemon([model]) as daemon:
        daemon.wait_ready()
        with Client(daemon.endpoint, timeout=30) as client:
            y = client.infer("exported", x)
    with torch.no_grad():
        assert torch.allclose(y, reference_model(in_features=16, hidden=32, out_features=4)(x),
                              rtol=1e-5, atol=1e-6)
        assert not torch.allclose(y, exported(x), rtol=1e-3, atol=1e-3)


def test_the_memory_bench_judges_mmap_against_its_target(capsys):
    from bench.memory import report

    mb = 10 ** 6
    runtime, weights = [100 * mb] * 4, 200 * mb  # target: 4 x 100 + 1.2 x 200 = 640 MB
    assert report({"runtime": runtime, "load": [300 * mb] * 4, "mmap": [159 * mb] * 4}, weights, 4)
    assert "PASS" in capsys.readouterr().out
    assert not report({"runtime": runtime, "load": [300 * mb] * 4, "mmap": [161 * mb] * 4}, weights, 4)
    assert "FAIL" in capsys.readouterr().out
