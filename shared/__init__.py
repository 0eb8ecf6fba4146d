"""The wire and the common core, shared by the daemon, its workers, its gateway and its clients:
protocol, descriptors, codec, shm, fdchannel, sockets, errors, states, config, rawconfig, process.
It imports nothing of ours above it (tests/test_layering.py)."""

__version__ = "0.1.0"


def refuse_bare_import(name: str, installed_as: str) -> None:
    """The role folders install as ``modelwarden.<role>`` (pyproject.toml's package-dir): the same
    file imported as bare ``supervisor`` or ``shared`` (a repository root on sys.path) would be a
    second copy of every module, with its own state. Say so at once instead."""
    if name != installed_as:
        raise ImportError(f"{name!r} is modelwarden's {installed_as}, imported by its folder name; "
                          f"import {installed_as} instead (pip install -e . makes it importable)")


refuse_bare_import(__name__, "modelwarden.shared")
