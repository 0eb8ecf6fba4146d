"""The wire parsers under atheris (tests/fuzz/wire.py): a bounded run against the compiled
path, steered by the uncompiled copy's coverage, must find nothing; and every input libFuzzer
ever saved as a finding (tests/fuzz/crashes/) is replayed and must end in a typed error, the
same one compiled and uncompiled."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

FUZZ = ROOT / "tests" / "fuzz" / "wire.py"
CRASHES = ROOT / "tests" / "fuzz" / "crashes"
BOUNDED_S = 30  # make test's share; make fuzz runs FUZZ_SECONDS


def test_a_bounded_fuzz_run_of_the_wire_parsers_finds_nothing(tmp_path):
    before = set(CRASHES.glob("*"))
    result = subprocess.run([sys.executable, str(FUZZ), "--seconds", str(BOUNDED_S)], cwd=ROOT,
                            capture_output=True, text=True, timeout=BOUNDED_S + 120)
    found = set(CRASHES.glob("*")) - before
    assert result.returncode == 0 and not found, (
        f"the fuzzer found {sorted(path.name for path in found)} (kept in tests/fuzz/crashes/ "
        f"for the replay test):\n{result.stderr[-4000:]}")
    assert "Done " in result.stderr and "cov: " in result.stderr, result.stderr[-2000:]


def test_every_input_the_fuzzer_ever_found_ends_in_a_typed_error():
    inputs = sorted(CRASHES.glob("*"))
    result = subprocess.run([sys.executable, str(FUZZ), "--replay", *map(str, inputs)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"replayed {len(inputs)} input(s)" in result.stdout
