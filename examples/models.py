"""The example models, under the name the repository's configs and benches have always used.

They live in the package (``modelwarden.examples``) so that an installed wheel serves them too:
``source = "python:modelwarden.examples:make_mlp"`` works with nothing but the wheel.
"""

from modelwarden.examples import Identity, make_identity, make_mlp

__all__ = ["Identity", "make_identity", "make_mlp"]
