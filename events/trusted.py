"""Models built from values that are valid already, without validating them again.

The lifecycle rules build their decided events, outcomes, deadlines and holds from messages
validated at the edge and from their own rows; validating construction checks every field
again (patterns, lengths, the text checks: a few µs per model, a large part of the decide
stage) and finds nothing. ``built(Model, **values)`` leaves an instance exactly as validating
construction would (the same ``__dict__`` in field order with the defaults filled in, the same
``model_fields_set``), so it compares and serializes identically. pydantic's own
``model_construct`` does the same in Python and costs more than validating.

``builder(Model, *names)`` is the same for a model built on every input from the same fields
(a cause, an outcome, a deadline): a function of those fields' values, positionally, that
spares the keyword dictionary and the name checks of each call (a third of ``built``'s cost).

Only field names are checked: a value of the wrong type is not caught here. The core's
property tests (tests/test_lifecycle_properties.py) check that every event and outcome the rules
build equals its validated twin and serializes byte for byte as it does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
# The models are frozen (their __setattr__ refuses), so the slots are set through their
# descriptors: what object.__setattr__, which pydantic uses, does after looking each one up.
_set_dict = vars(BaseModel)["__dict__"].__set__
_set_fields_set = vars(BaseModel)["__pydantic_fields_set__"].__set__
_set_extra = vars(BaseModel)["__pydantic_extra__"].__set__
_set_private = vars(BaseModel)["__pydantic_private__"].__set__
_BUILDERS: dict[type[Any], Callable[..., Any]] = {}


def built(cls: type[M], /, **values: Any) -> M:
    """``cls(**values)`` for values that are valid already (no validation, no coercion)."""
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _builder(cls)
    return build(values)  # type: ignore[no-any-return]


def builder(cls: type[M], /, *names: str) -> Callable[..., M]:
    """A function of the values of ``names``, in that order: ``builder(cls, "a", "b")(x, y)``
    is ``built(cls, a=x, b=y)``."""
    template, required, factories = _fields(cls)
    if unknown := sorted(set(names) - template.keys()):
        raise TypeError(f"{cls.__name__}: unknown fields {unknown}")
    if missing := sorted(required - set(names)):
        raise TypeError(f"{cls.__name__}: missing {missing}")
    if len(set(names)) != len(names):
        raise TypeError(f"{cls.__name__}: a field named twice in {names}")
    made = dict(factories)
    given = {name: f"v{n}" for n, name in enumerate(names)}
    # Every field in order: a given value, a fresh default from its factory, or the default.
    entries = ", ".join(
        f"{name!r}: {given[name]}" if name in given
        else f"{name!r}: _factory_{name}()" if name in made
        else f"{name!r}: _default_{name}"
        for name in template
    )  # fmt: skip
    fields_set = "{" + ", ".join(repr(n) for n in names) + "}" if names else "set()"
    source = (
        f"def build({', '.join(given.values())}):\n"
        "    model = _new(cls)\n"
        f"    _set_dict(model, {{{entries}}})\n"
        f"    _set_fields_set(model, {fields_set})\n"
        "    _set_extra(model, None)\n"
        "    _set_private(model, None)\n"
        "    return model\n"
    )
    scope: dict[str, Any] = {
        "_new": _new, "cls": cls, "_set_dict": _set_dict, "_set_fields_set": _set_fields_set,
        "_set_extra": _set_extra, "_set_private": _set_private,
        **{f"_factory_{name}": factory for name, factory in factories},
        **{f"_default_{name}": value for name, value in template.items()},
    }  # fmt: skip
    exec(source, scope)  # the source is built from the model's own field names
    return scope["build"]  # type: ignore[no-any-return]


def _fields(
    cls: type[M],
) -> tuple[dict[str, Any], set[str], list[tuple[str, Callable[[], Any]]]]:
    """Every field in order with its default (None for the required and the factory-made),
    the required ones, and the factories; after checking ``cls`` is a model ``built`` serves."""
    if cls.model_config.get("extra") != "forbid" or cls.__pydantic_root_model__:
        raise TypeError(f"{cls.__name__}: built() serves models with extra='forbid' only")
    if cls.__pydantic_post_init__ or cls.__private_attributes__:
        raise TypeError(f"{cls.__name__}: built() does not run post-init or private attributes")
    template: dict[str, Any] = {}
    required: set[str] = set()
    factories: list[tuple[str, Callable[[], Any]]] = []
    for name, info in cls.model_fields.items():
        if info.alias is not None or info.validation_alias is not None:
            raise TypeError(f"{cls.__name__}.{name}: built() does not resolve aliases")
        template[name] = None if info.is_required() or info.default_factory else info.default
        if info.is_required():
            required.add(name)
        elif info.default_factory is not None:
            if info.default_factory_takes_validated_data:
                raise TypeError(f"{cls.__name__}.{name}: a factory taking data is not supported")
            factories.append((name, info.default_factory))  # type: ignore[arg-type]
    return template, required, factories


def _builder(cls: type[M]) -> Callable[[dict[str, Any]], M]:
    """The builder of one model, after checking that it is one ``built`` serves."""
    template, required, factories = _fields(cls)  # required ones are always given
    size = len(template)

    def build(values: dict[str, Any]) -> M:
        data = template.copy()
        data.update(values)  # given fields replace their placeholders in place: order kept
        if len(data) != size or not required <= values.keys():
            unknown, missing = sorted(values.keys() - template), sorted(required - values.keys())
            raise TypeError(f"{cls.__name__}: unknown fields {unknown}, missing {missing}")
        for name, factory in factories:
            if name not in values:
                data[name] = factory()  # a fresh default, as validation gives
        model = _new(cls)
        _set_dict(model, data)
        _set_fields_set(model, set(values))
        _set_extra(model, None)
        _set_private(model, None)
        return model

    return build
