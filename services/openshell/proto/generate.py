"""Regenerate the modules of the OpenShell protos: `python -m services.openshell.proto.generate`.

The ``.proto`` files import each other by their path from the repository root, so the
generated modules import each other as ``services.openshell.proto.*_pb2``. Type stubs (``.pyi``)
come from mypy-protobuf. The generated files are committed; a test regenerates them into a
scratch folder and fails when the committed ones differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent.parent.parent
SOURCES = ("datamodel.proto", "sandbox.proto", "openshell.proto")
WITH_SERVICE = ("openshell.proto",)  # the others declare messages only


def generated_names() -> list[str]:
    names = []
    for source in SOURCES:
        stem = source.removesuffix(".proto")
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
        if source in WITH_SERVICE:
            names += [f"{stem}_pb2_grpc.py", f"{stem}_pb2_grpc.pyi"]
    return names


def generate(out: Path) -> None:
    """Write the generated modules below ``out`` (``out/services/openshell/proto/...``)."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    bindir = Path(sys.executable).parent
    relative = [str((PROTO_DIR / s).relative_to(ROOT)) for s in SOURCES]
    plugins = [
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
    ]
    base = ["protoc", f"-I{ROOT}", *plugins]
    messages = [*base, f"--python_out={out}", f"--mypy_out=quiet:{out}", *relative]
    services = [
        *base,
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out=quiet:{out}",
        *[r for r, s in zip(relative, SOURCES, strict=True) if s in WITH_SERVICE],
    ]
    for args in (messages, services):
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(ROOT)
    print("\n".join(generated_names()))
