"""Regenerate the modules of the OpenShell protos: `python -m services.openshell.proto.generate`.

The ``.proto`` files import each other by their path from the repository root, so the
generated modules import each other as ``services.openshell.proto.*_pb2``. Type stubs (``.pyi``)
come from mypy-protobuf. The vendored releases (``vendored/openshell-<version>.binpb``, written
by ``vendor.py`` from the PyPI wheels) are compiled from their descriptor sets into
``vendored/v<version>/``, messages only. The generated files are committed; a test regenerates
them into a scratch folder and fails when the committed ones differ.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, duration_pb2, struct_pb2, timestamp_pb2

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent.parent.parent
SOURCES = ("datamodel.proto", "sandbox.proto", "openshell.proto", "served.proto")
WITH_SERVICE = ("openshell.proto",)  # the others declare messages only
VENDORED = PROTO_DIR / "vendored"
VENDORED_FILES = ("datamodel.proto", "sandbox.proto", "openshell.proto")
# The well-known files the vendored sets import (protoc needs them in the set it reads).
WELL_KNOWN = (duration_pb2, struct_pb2, timestamp_pb2)


def vendored_sets() -> list[Path]:
    return sorted(VENDORED.glob("openshell-*.binpb"))


def _vendored_dir(binpb: Path) -> str:
    version = binpb.stem.removeprefix("openshell-")
    return "vendored/v" + version.replace(".", "_")


def generated_names() -> list[str]:
    names = []
    for source in SOURCES:
        stem = source.removesuffix(".proto")
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
        if source in WITH_SERVICE:
            names += [f"{stem}_pb2_grpc.py", f"{stem}_pb2_grpc.pyi"]
    for binpb in vendored_sets():
        for source in VENDORED_FILES:
            stem = source.removesuffix(".proto")
            names += [
                f"{_vendored_dir(binpb)}/{stem}_pb2.py",
                f"{_vendored_dir(binpb)}/{stem}_pb2.pyi",
            ]
    return names


def _with_well_known(binpb: Path, scratch: Path) -> Path:
    bundle = descriptor_pb2.FileDescriptorSet()
    for module in WELL_KNOWN:
        bundle.file.add().ParseFromString(module.DESCRIPTOR.serialized_pb)
    bundle.MergeFromString(binpb.read_bytes())
    path = scratch / binpb.name
    path.write_bytes(bundle.SerializeToString())
    return path


def generate(out: Path) -> None:
    """Write the generated modules below ``out`` (``out/services/openshell/proto/...``)."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    bindir = Path(sys.executable).parent
    relative = [str((PROTO_DIR / s).relative_to(ROOT)) for s in SOURCES]
    plugins = [
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
    ]
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    base = ["protoc", f"-I{ROOT}", f"-I{well_known}", *plugins]
    messages = [*base, f"--python_out={out}", f"--mypy_out=quiet:{out}", *relative]
    services = [
        *base,
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out=quiet:{out}",
        *[r for r, s in zip(relative, SOURCES, strict=True) if s in WITH_SERVICE],
    ]
    runs = [messages, services]
    with tempfile.TemporaryDirectory() as scratch:
        for binpb in vendored_sets():
            directory = PROTO_DIR.relative_to(ROOT) / _vendored_dir(binpb)
            files = [str(directory / name) for name in VENDORED_FILES]
            bundle = _with_well_known(binpb, Path(scratch))
            runs.append(
                [base[0], f"--descriptor_set_in={bundle}", *plugins, f"--python_out={out}",
                 f"--mypy_out=quiet:{out}", *files]
            )  # fmt: skip
        for args in runs:
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(ROOT)
    print("\n".join(generated_names()))
