"""Vendor a released OpenShell SDK's protocol: ``python -m services.openshell.proto.vendor WHEEL``.

The ``openshell`` wheels on PyPI ship generated ``*_pb2.py`` modules, not ``.proto`` sources.
Each module embeds its file's serialized ``FileDescriptorProto`` (the argument of
``AddSerializedFile``), which is exactly what protoc compiled: every message, field number,
type, enum value, reserved range and option. This tool reads those bytes out of the wheel
(without importing its code), keeps the files the gateway API needs (``openshell.proto`` and
what it imports), and writes them as one ``FileDescriptorSet`` to
``vendored/openshell-<version>.binpb``; ``generate.py`` then compiles that set with protoc
(``--descriptor_set_in``) into ``vendored/v<version>/``.

``options.proto`` (two annotations, no wire effect) is left out: see ``OPTIONS_FILE``. Two
things are renamed so that several versions and the pinned subset can live in one process
(one protobuf descriptor pool): the file names (``openshell.proto`` becomes
``services/openshell/proto/vendored/v0_1_5/openshell.proto``, so the generated modules import
each other by package path) and the protobuf packages (``openshell.v1`` becomes
``vendored.v0_1_5.openshell.v1``). Neither is on the wire: a message's encoding depends on
its field numbers and types only, and the server routes calls by OpenShell's own method paths
(``/openshell.v1.OpenShell/...``), not by the vendored service's name.
"""

from __future__ import annotations

import argparse
import ast
import re
import zipfile
from pathlib import Path
from typing import Final

from google.protobuf import descriptor_pb2

VENDORED_DIR: Final = Path(__file__).resolve().parent / "vendored"
MODULE_DIR: Final = "services/openshell/proto/vendored"
# The gateway API's files, in dependency order; the wheel's others (inference.proto) are left.
FILES: Final = ("datamodel.proto", "sandbox.proto", "openshell.proto")
# Declares the annotations `authorization` (MethodOptions 50000) and `secret` (FieldOptions
# 50001). Every release declares the same extension numbers, which one descriptor pool refuses
# twice, so it is left out; the annotations' values stay in the options as unparsed bytes.
OPTIONS_FILE: Final = "options.proto"
_TYPE_REFERENCES: Final = frozenset({"type_name", "extendee", "input_type", "output_type"})
_VERSION = re.compile(r"^openshell-(\d+\.\d+\.\d+)(?:-|\.dist-info)")


def tag(version: str) -> str:
    """``0.1.5`` -> ``v0_1_5`` (a Python package name)."""
    return "v" + version.replace(".", "_")


def serialized_file(source: str) -> bytes:
    """The bytes a generated ``*_pb2.py`` passes to ``AddSerializedFile``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            value = node.args[0]
            if isinstance(value, ast.Constant) and isinstance(value.value, bytes):
                return value.value
    raise ValueError("no AddSerializedFile(b'...') call found")


def wheel_version(wheel: zipfile.ZipFile) -> str:
    for name in wheel.namelist():
        found = _VERSION.match(name)
        if found:
            return found.group(1)
    raise ValueError("not an openshell wheel: no openshell-<version>.dist-info")


def read_wheel(path: Path) -> tuple[str, list[descriptor_pb2.FileDescriptorProto]]:
    """The wheel's version and its gateway API files, exactly as its modules embed them."""
    with zipfile.ZipFile(path) as wheel:
        version = wheel_version(wheel)
        files = []
        for name in FILES:
            module = f"openshell/_proto/{name.removesuffix('.proto')}_pb2.py"
            raw = serialized_file(wheel.read(module).decode())
            files.append(descriptor_pb2.FileDescriptorProto.FromString(raw))
    return version, files


def _rename_types(
    item: descriptor_pb2.FieldDescriptorProto | descriptor_pb2.MethodDescriptorProto,
    prefix: str,
) -> None:
    """Prefix the references to OpenShell's types; a field left unset stays unset."""
    for field, value in item.ListFields():  # the fields set, only
        if field.name in _TYPE_REFERENCES and value.startswith(".openshell."):
            setattr(item, field.name, "." + prefix + value[1:])


def _rename_message(message: descriptor_pb2.DescriptorProto, prefix: str) -> None:
    for field in [*message.field, *message.extension]:
        _rename_types(field, prefix)
    for nested in message.nested_type:
        _rename_message(nested, prefix)


def rename(
    files: list[descriptor_pb2.FileDescriptorProto], version: str
) -> descriptor_pb2.FileDescriptorSet:
    """The files under sandstream's paths and packages (see the module's docstring)."""
    prefix = f"vendored.{tag(version)}."
    directory = f"{MODULE_DIR}/{tag(version)}/"
    ours = {f.name for f in files}
    renamed = descriptor_pb2.FileDescriptorSet()
    for original in files:
        file = renamed.file.add()
        file.CopyFrom(original)
        file.name = directory + original.name
        file.package = prefix + original.package
        file.dependency[:] = [
            directory + d if d in ours else d for d in original.dependency if d != OPTIONS_FILE
        ]
        for message in file.message_type:
            _rename_message(message, prefix)
        for extension in file.extension:
            _rename_types(extension, prefix)
        for service in file.service:
            for method in service.method:
                _rename_types(method, prefix)
    return renamed


def vendor(wheel: Path, out: Path = VENDORED_DIR) -> Path:
    version, files = read_wheel(wheel)
    target = out / f"openshell-{version}.binpb"
    target.write_bytes(rename(files, version).SerializeToString(deterministic=True))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="+", type=Path, help="openshell-<version>-*.whl")
    for wheel in parser.parse_args().wheels:
        print(vendor(wheel))


if __name__ == "__main__":
    main()
