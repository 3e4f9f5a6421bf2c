"""The house rules of the layout: imports run one way (events <- projections <- drivers <-
services), each role package of services/ imports only the packages it is allowed to, and no
module imports itself back through others. An AST walk, so function-level imports count too."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.settings import PROJECT_ROOT

LAYERS = ("events", "projections", "drivers", "services")

# What each role package of services/ may import besides the lower layers (and itself).
# README's layout table and each package docstring say the same in words.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "processor": {"common"},
    "executor": {"common"},
    "audit": {"common", "processor"},
    "scheduler": {"common"},
    "api": {"common", "audit", "executor"},
    "provider_sync": {"common", "api"},
    "localstack": {"common"},
    "openshell": {"common", "api", "executor", "localstack"},
    "up": {
        "common",
        "processor",
        "executor",
        "scheduler",
        "api",
        "provider_sync",
        "localstack",
        "openshell",
    },
    "roles": {"common", "processor", "executor", "scheduler", "api", "provider_sync", "localstack"},
    "cli": {"common", "api", "provider_sync", "processor", "up", "audit", "roles"},
    "bench": {"common", "processor", "executor", "api", "up", "localstack", "chaos"},
    "chaos": {"common", "processor", "executor", "audit", "api", "localstack"},
}
# Libraries a lower layer must not reach for: events/ holds schemas and Kafka helpers only.
FORBIDDEN_LIBRARIES = {"events": {"asyncpg", "fastapi", "podman"}}


def modules() -> Iterator[tuple[str, Path]]:
    for layer in LAYERS:
        for path in sorted((PROJECT_ROOT / layer).rglob("*.py")):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def imports_of(name: str, path: Path) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # ``from services.api import readmodel`` imports the module services.api.readmodel
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    names = dict(modules())
    return {
        name: {i for i in imports_of(name, path) if i in names and i != name}
        for name, path in names.items()
    }


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = []
    for name, path in modules():
        layer = LAYERS.index(name.split(".")[0])
        for imported in imports_of(name, path):
            top = imported.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > layer:
                wrong.append(f"{name} imports {imported}")
            if top in FORBIDDEN_LIBRARIES.get(LAYERS[layer], set()):
                wrong.append(f"{name} uses {top}")
    assert wrong == []


def test_service_roles_import_only_what_they_may() -> None:
    wrong = []
    for name, path in modules():
        parts = name.split(".")
        if parts[0] != "services" or len(parts) < 2:
            continue
        role = parts[1]
        assert role in ALLOWED, f"services/{role} is not in the house table"
        for imported in imports_of(name, path):
            other = imported.split(".")
            foreign = other[0] == "services" and len(other) > 1 and other[1] != role
            if foreign and other[1] not in ALLOWED[role]:
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def test_the_role_table_itself_has_no_cycle() -> None:
    assert find_cycle({role: set(deps) for role, deps in ALLOWED.items()}) is None


def test_no_module_imports_itself_back() -> None:
    assert find_cycle(graph()) is None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_folder_of_code_is_a_package() -> None:
    folders = {p.parent for _, p in modules()}
    assert sorted(str(f) for f in folders if not (f / "__init__.py").exists()) == []


@pytest.mark.parametrize("package", sorted({n for n, p in modules() if p.name == "__init__.py"}))
def test_every_package_says_what_it_owns(package: str) -> None:
    path = PROJECT_ROOT.joinpath(*package.split("."), "__init__.py")
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.split()) >= 8, f"{package} needs a docstring saying what it owns"


def test_openapi_document_is_current() -> None:
    from services.api.openapi_export import CHECKED_IN, render

    regenerate = "python -m services.api.openapi_export"
    assert CHECKED_IN.read_text() == render(), f"docs/openapi.json is stale: run `{regenerate}`"
    assert json.loads(CHECKED_IN.read_text())["info"]["title"] == "sandstream"


# Role packages split into rooms a reader can hold in one sitting: no module over ~600 lines,
# no class over ~300, each module (and sub-package) named in the package docstring on a line
# of its own (``- ``name``: what it holds``).
# Generated protobuf code is not a room anyone reads.
SPLIT_PACKAGES = (
    *sorted(n for n, p in modules() if n.startswith("services.") and p.name == "__init__.py"
            and not n.endswith(".proto") and ".proto." not in n),
    "projections.lifecycle",  # the rules: one module per table family
)  # fmt: skip
# The layers under the roles keep to the same sizes (their package docstrings need not list).
LAYER_PACKAGES = ("events", "projections", "drivers")
MAX_MODULE_LINES, MAX_CLASS_LINES = 600, 300
# A room that must stay larger, and why.
LARGER_ROOMS = {
    "settings.py: class Settings": "one field per SANDSTREAM_* setting with the comment that "
    "documents it: the one place an operator reads them all",
}


def _package_modules(package: str) -> list[Path]:
    return sorted(PROJECT_ROOT.joinpath(*package.split(".")).glob("*.py"))


def _oversized(package: str) -> list[str]:
    too_long = []
    for path in _package_modules(package):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_long.append(f"{path.name}: class {node.name}")
    return too_long


@pytest.mark.parametrize("package", SPLIT_PACKAGES)
def test_a_split_package_has_no_module_or_class_too_long_to_read_in_one_sitting(
    package: str,
) -> None:
    assert [room for room in _oversized(package) if room not in LARGER_ROOMS] == []


@pytest.mark.parametrize("package", LAYER_PACKAGES)
def test_a_layer_has_no_module_or_class_too_long_to_read_in_one_sitting(package: str) -> None:
    assert _oversized(package) == []


def test_every_larger_room_is_still_larger() -> None:
    """An exemption goes when its room shrinks back under the limit."""
    oversized = {room for package in SPLIT_PACKAGES for room in _oversized(package)}
    assert set(LARGER_ROOMS) <= oversized


@pytest.mark.parametrize("package", SPLIT_PACKAGES)
def test_a_split_package_names_each_of_its_modules_in_its_docstring(package: str) -> None:
    init = PROJECT_ROOT.joinpath(*package.split("."), "__init__.py")
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    heads = [line.partition(":")[0] for line in doc.splitlines() if line.startswith("- ``")]
    listed = {name for head in heads for name in re.findall(r"``(\w+)/?``", head)}
    folder = PROJECT_ROOT.joinpath(*package.split("."))
    names = {p.stem for p in _package_modules(package)} - {"__init__", "__main__"}
    names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    assert listed == names


_CONFLICT_MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)


def test_no_tracked_text_file_keeps_a_merge_conflict_marker() -> None:
    """A merge resolved in haste once left three conflicts in docs/state-machine.md."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.sql", "*.yaml", "*.toml", "*.sh"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    marked = [
        name for name in tracked if _CONFLICT_MARKER.search((PROJECT_ROOT / name).read_text())
    ]
    assert marked == []
