"""Sentence embeddings from a daemon serving examples/minilm.toml, and how alike the sentences are.

    python examples/minilm_client.py [--endpoint ipc://...] [--length 32] SENTENCE [SENTENCE ...]

Tokenisation happens here, in the client (the daemon serves tensors): every sentence becomes
input_ids and attention_mask padded to ``--length`` tokens, sent as its own request, all at once
(so the daemon can batch them). Prints each embedding's first values and the cosine similarity of
every pair (the embeddings have unit length: their dot product). Needs the examples extra.
"""

from __future__ import annotations

import argparse
import sys

from modelwarden import Client
from modelwarden.minilm import EXTRA_MISSING, Tokenizer, available, cosine


def embed(client: Client, tokenizer: Tokenizer, sentences: list[str], model: str = "minilm"):
    """One [384] embedding per sentence, one request per sentence, all in flight together."""
    futures = []
    for sentence in sentences:
        ids, mask = tokenizer([sentence])
        futures.append(client.submit(model, [ids, mask]))
    return [future.result()[0] for future in futures]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sentences", nargs="+")
    parser.add_argument("--endpoint", default=None, help="default: the local daemon's frontend")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence (padded, truncated)")
    args = parser.parse_args(argv)
    if not available():
        print(EXTRA_MISSING, file=sys.stderr)
        return 2
    tokenizer = Tokenizer(args.length)
    with Client(args.endpoint) as client:
        embeddings = embed(client, tokenizer, args.sentences, args.model)
    for sentence, embedding in zip(args.sentences, embeddings):
        print(f"{sentence!r}: [{', '.join(f'{value:.4f}' for value in embedding[:4].tolist())}, ...]")
    for i, first in enumerate(args.sentences):
        for j in range(i + 1, len(args.sentences)):
            print(f"cosine {i} {j} {cosine(embeddings[i], embeddings[j]):.3f}  "
                  f"{first!r} ~ {args.sentences[j]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
