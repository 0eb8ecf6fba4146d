"""Classify texts with a daemon serving examples/textclassifier.toml: one request, many texts.

    python examples/textclassifier_client.py [--endpoint ipc://...] TEXT [TEXT ...]

The texts travel as they are (str elements on the wire): the tokenizer lives in the worker, so
this client needs no tokenizer and no example extra. Prints each text's logits and its class
(0 negative, 1 positive). The same call through the KServe v2 gateway, with curl:

    curl -s localhost:8000/v2/models/textclassifier/infer -H 'content-type: application/json' \\
      -d '{"inputs": [{"name": "texts", "shape": [2], "datatype": "BYTES",
                       "data": ["What a great film.", "Broken on arrival."]}]}'
"""

from __future__ import annotations

import argparse
import sys

from modelwarden import Client

CLASSES = ("negative", "positive")


def classify(client: Client, texts: list[str], model: str = "textclassifier"):
    """logits [n, 2], one row per text, from one request."""
    reply = client.infer(model, texts)
    return reply["logits"] if isinstance(reply, dict) else reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+")
    parser.add_argument("--endpoint", default=None, help="default: the local daemon's frontend")
    parser.add_argument("--model", default="textclassifier")
    args = parser.parse_args(argv)
    with Client(args.endpoint) as client:
        logits = classify(client, args.texts, args.model)
    for text, row in zip(args.texts, logits.tolist()):
        label = max(range(len(row)), key=row.__getitem__)
        print(f"{CLASSES[label]:8s} [{', '.join(f'{value:6.2f}' for value in row)}]  {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
