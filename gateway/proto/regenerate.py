"""Regenerate the gRPC stubs from grpc_predict_v2.proto with grpcio-tools (``make stubs``).

The generated modules are committed, so installing modelwarden needs no code generation;
tests/test_unit_kserve.py runs ``generate`` into a temporary directory and checks the committed
files are what the .proto and grpcio-tools give. The .proto is compiled as
``modelwarden/gateway/proto/grpc_predict_v2.proto`` so the generated import is our package's.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "grpc_predict_v2.proto"
GENERATED = ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2_grpc.py")
PACKAGE_PATH = Path("modelwarden", "gateway", "proto")


def generate(out_dir: Path) -> list[Path]:
    """Compile the .proto into ``out_dir``; returns the generated files."""
    from grpc_tools import protoc  # grpcio-tools: only here, never at run time

    with tempfile.TemporaryDirectory() as tree:
        source = Path(tree, PACKAGE_PATH)
        source.mkdir(parents=True)
        shutil.copy(HERE / PROTO, source / PROTO)
        include = str(Path(protoc.__file__).parent / "_proto")
        code = protoc.main(["protoc", f"-I{tree}", f"-I{include}", f"--python_out={tree}",
                            f"--grpc_python_out={tree}", str(PACKAGE_PATH / PROTO)])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(source / name, out_dir / name)) for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
