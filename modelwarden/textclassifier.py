"""The background article's BERT service as a handler: texts in, 2-class logits out.

    source = "handler:modelwarden.textclassifier:TextClassifier"    (examples/textclassifier.toml)

all-MiniLM-L6-v2 (modelwarden/minilm.py, the ``examples`` extra) embeds each text; the head is
not trained but written down: a few example sentences per class (PROTOTYPES below, class 0
"negative", class 1 "positive" reviews) are embedded at load, and a text's logits are
``scale`` x the cosine similarity of its embedding to each class's mean prototype embedding. So
the logits mean something a reader can check (HELD_OUT: sentences the prototypes do not contain,
each with its class), and a new version of the service is a new list of sentences or a new scale.

The tokenizer lives here, in the worker: a request is its texts (a list of 1 to MAX_TEXTS str,
bare or as ``{"texts": [...]}``); ``preprocess`` tokenises them to at most MAX_TOKENS tokens,
padded only to the longest of the request's own texts, and the worker pads further within a
batch (``[models.batching] buckets``). Nothing here is imported by the daemon unless a config
names this class: the examples extra may be absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modelwarden.handler import BadInput, Handler
from modelwarden.minilm import TOKENIZER_FILE, load_minilm, package_file

MAX_TEXTS = 128  # per request, as the article's service takes 1-128 texts
MAX_TOKENS = 128  # [CLS] + 126 word pieces + [SEP]; longer texts are cut (the last bucket)
SCALE = 20.0  # cosine similarities differ by tenths between classes; x20 gives logits of ~1-4
CLASSES = ("negative", "positive")

PROTOTYPES = {
    "negative": [
        "This movie was terrible and a complete waste of time.",
        "The product broke after one day, I want my money back.",
        "Awful service, the staff were rude and the food was cold.",
        "I hated every minute of it, truly disappointing.",
        "Poor quality, it does not work as advertised.",
        "The worst purchase I have ever made.",
    ],
    "positive": [
        "This movie was wonderful and I enjoyed every minute.",
        "The product works perfectly, I am very happy with it.",
        "Excellent service, the staff were friendly and the food was delicious.",
        "I loved it, a truly delightful experience.",
        "Great quality, it works exactly as advertised.",
        "The best purchase I have ever made.",
    ],
}

# Not among the prototypes: what the example is checked against (tests/test_textclassifier.py).
HELD_OUT = [
    ("The hotel room was dirty and smelled bad.", 0),
    ("Customer support never answered my emails.", 0),
    ("The battery died within an hour, very annoying.", 0),
    ("What a fantastic concert, the band was amazing!", 1),
    ("The new phone is fast and the camera is superb.", 1),
    ("Our waiter was charming and the dessert was heavenly.", 1),
]

PROBE_TEXTS = ["A great film with a moving story.", "Broken on arrival, never buying again."]


class TextClassifier(Handler):
    """all-MiniLM-L6-v2 with a prototype head: ``texts`` -> ``logits`` float32 [n, 2]."""

    def load(self, device: torch.device, threads: int, scale: float = SCALE,
             pad_to: int | None = None, **_: Any) -> None:
        """``pad_to`` (tokens): pad every text to this length, as the article's first version
        did (max_len); bench/text.py's "buckets off". Default: to the request's longest text."""
        from tokenizers import Tokenizer as WordPiece

        self.device = torch.device(device)
        self.model = load_minilm("mmap").to(self.device)
        self.scale = float(scale)
        self.tokenizer = WordPiece.from_file(str(package_file(TOKENIZER_FILE)))
        self.tokenizer.enable_truncation(max_length=MAX_TOKENS)
        # the file pads every text to 128: pad only to the request's longest text instead
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=pad_to)
        self.prototypes = self._class_embeddings()

    def _class_embeddings(self) -> torch.Tensor:
        """Per class, the unit-length mean of its prototypes' embeddings: [classes, 384]."""
        means = []
        with torch.inference_mode():
            for name in CLASSES:
                embedded = self.model(**self.preprocess(PROTOTYPES[name]))
                means.append(torch.nn.functional.normalize(embedded.mean(0), dim=0))
        return torch.stack(means)

    def preprocess(self, inputs: Any) -> dict[str, torch.Tensor]:
        texts = request_texts(inputs)
        encoded = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([item.ids for item in encoded], dtype=torch.int64)
        mask = torch.tensor([item.attention_mask for item in encoded], dtype=torch.int64)
        return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        embeddings = self.model(batch["input_ids"], batch["attention_mask"])
        return {"logits": (self.scale * embeddings @ self.prototypes.T).float()}

    def postprocess(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"logits": outputs["logits"]}


def request_texts(inputs: Any) -> list[str]:
    """A request's texts: a list of str (or of UTF-8 bytes, as KServe BYTES may arrive; or of
    one-element lists, a [n, 1] tensor's shape), bare, or under "texts" in a dict."""
    if isinstance(inputs, dict):
        if "texts" not in inputs:
            raise BadInput(f"expected an input named 'texts', got {sorted(map(str, inputs))}")
        inputs = inputs["texts"]
    if isinstance(inputs, (str, bytes)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)):
        raise BadInput(f"texts must be a list of str, got {type(inputs).__name__}")
    if not 1 <= len(inputs) <= MAX_TEXTS:
        raise BadInput(f"expected 1 to {MAX_TEXTS} texts, got {len(inputs)}")
    return [_text(item, index) for index, item in enumerate(inputs)]


def _text(item: Any, index: int) -> str:
    if isinstance(item, (list, tuple)) and len(item) == 1:
        item = item[0]
    if isinstance(item, bytes):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"text {index} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if not isinstance(item, str):
        raise BadInput(f"text {index} is a {type(item).__name__}, not a str")
    return item


def load_in_process(scale: float = SCALE, pad_to: int | None = None) -> TextClassifier:
    """The handler loaded here, as a worker loads it (tests, benches, the golden)."""
    handler = TextClassifier()
    handler.load(torch.device("cpu"), torch.get_num_threads(), scale=scale, pad_to=pad_to)
    return handler


def classify(handler: TextClassifier, texts: list[str]) -> torch.Tensor:
    """One request through the four hooks, in this process: logits [n, 2]."""
    with torch.inference_mode():
        return handler.postprocess(handler.forward(handler.preprocess(texts)))["logits"]


def write_probe_files(directory: Path) -> None:
    """The sentinel's request (``textclassifier_probe.json``: {"texts": PROBE_TEXTS}) and its
    golden answer (``textclassifier_golden.npy``: their logits, computed here), as examples/
    ships them."""
    import json

    import numpy as np

    request = {"texts": PROBE_TEXTS}
    (directory / "textclassifier_probe.json").write_text(json.dumps(request, indent=1) + "\n")
    logits = classify(load_in_process(), PROBE_TEXTS)
    np.save(directory / "textclassifier_golden.npy", logits.numpy())
