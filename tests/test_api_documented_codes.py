"""Every status a route raises itself is in its OpenAPI responses, so a client (and the
fuzzer, which checks responses against the document) is never told of a code it was not
promised. Found by the fuzzer: deleting an attached provider answered an undocumented 412."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from fastapi.routing import APIRoute

from services.api.app import ROUTE_MODULES


def raised_codes(endpoint: Any) -> set[int]:
    """The literal status codes of ``ApiError(...)`` in the endpoint's own body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(endpoint)))
    codes = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "ApiError"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, int)
        ):
            codes.add(node.args[0].value)
    return codes


def test_every_status_a_route_raises_is_documented() -> None:
    missing = {}
    routes = [r for module in ROUTE_MODULES for r in module.router.routes]
    assert len(routes) > 20
    for route in routes:
        if isinstance(route, APIRoute):
            documented = {int(code) for code in route.responses}
            undocumented = raised_codes(route.endpoint) - documented
            if undocumented:
                missing[f"{sorted(route.methods)} {route.path}"] = sorted(undocumented)
    assert missing == {}


def test_the_check_sees_a_raise_in_a_route_body() -> None:
    async def handler() -> None:
        raise ApiError(412, "FAILED_PRECONDITION", "x")  # noqa: F821

    assert raised_codes(handler) == {412}
