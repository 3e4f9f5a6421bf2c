"""A faster ``dataclasses.replace`` for the frozen, slotted row types of the hot path.

``dataclasses.replace`` looks up the fields and runs ``__init__`` on every call; a row is
replaced once per decided event and once per history entry, which made it a tenth of the
processor's time. This copies the fields straight into a new instance (the types it serves
have no ``__post_init__``: tests/test_records.py checks the result equals replace's).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")

_new = object.__new__
_set = object.__setattr__  # how a frozen dataclass's own __init__ sets its fields
_NAMES: dict[type, tuple[str, ...]] = {}


def replaced(obj: T, /, **changes: Any) -> T:
    """``dataclasses.replace(obj, **changes)`` for a dataclass without ``__post_init__``."""
    cls = type(obj)
    names = _NAMES.get(cls)
    if names is None:
        assert not hasattr(cls, "__post_init__"), f"{cls.__name__} needs dataclasses.replace"
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    new = _new(cls)
    for name in names:
        _set(new, name, changes[name] if name in changes else getattr(obj, name))
    return new
