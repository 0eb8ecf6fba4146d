"""Models that take and give str/bytes elements, for the wire tests (``python:`` sources).

``make_upper()``: a list of str in (or one str), ``(lengths, upper-cased)`` out: an int64
tensor of each text's length in characters and the texts upper-cased, a list of str: both
halves of the element codec at once. ``make_blobs()``: bytes in, their byte sums (int64) and
the bytes reversed out.
"""

from __future__ import annotations

import torch


class Upper:
    def __call__(self, texts):
        if isinstance(texts, str):
            return torch.tensor(len(texts)), texts.upper()
        if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
            raise TypeError(f"expected a list of str, got {type(texts).__name__}")
        return torch.tensor([len(text) for text in texts], dtype=torch.int64), \
            [text.upper() for text in texts]


class Blobs:
    def __call__(self, blobs):
        if not isinstance(blobs, list) or not all(isinstance(blob, bytes) for blob in blobs):
            raise TypeError(f"expected a list of bytes, got {type(blobs).__name__}")
        return torch.tensor([sum(blob) for blob in blobs], dtype=torch.int64), \
            [blob[::-1] for blob in blobs]


def make_upper() -> Upper:
    return Upper()


def make_blobs() -> Blobs:
    return Blobs()
