"""An exec's steps marked in the process, for the benches that time the HTTP exec route
(``exec``: services/bench/exec_route.py; ``warm``: services/bench/warm.py): the route's
functions and the Podman driver's exec steps wrapped with timers for a run only, and the
request's arrival and answer marked by an ASGI middleware. Each mark is the first time an exec
reaches the step, in ms from its send."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from drivers import podman_runc
from drivers.podman import PodmanDriver
from services.api import readmodel
from services.api.deps import ApiState
from services.api.routes import exec as exec_route

# The steps, in the order an exec meets them (the label printed, the mark's name).
STEPS = (
    ("request at the app", "app"),
    ("auth and scope checked", "auth"),
    ("row read (name resolved)", "row"),
    ("wake check (Ready: none)", "woken"),
    ("use recorded (idle suspend)", "use"),
    ("claim's env read", "env"),
    ("driver: container looked up (not remembered)", "lookup"),
    ("driver: the container's process read (runc)", "spec"),
    ("driver: runc exec started (runc)", "runc"),
    ("driver: the command started (runc's pid file)", "started"),
    ("driver: first event", "first"),
    ("driver: last event", "last"),
    ("answer started", "start"),
    ("answer ended", "end"),
    ("answer at the client", "client"),
)


class Timeline:
    """The current exec's steps: the first time each is reached, in ms from its send."""

    def __init__(self) -> None:
        self.began = 0.0
        self.marks: dict[str, float] = {}

    def start(self) -> None:
        self.began, self.marks = time.perf_counter(), {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, (time.perf_counter() - self.began) * 1000)

    def keep(self, into: dict[str, list[float]]) -> None:
        """This exec's marks, added to ``into`` (a form's samples by mark)."""
        for mark, at in self.marks.items():
            into[mark].append(at)


def _after(timeline: Timeline, mark: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        finally:
            timeline.mark(mark)

    return timed


def _sync_after(timeline: Timeline, mark: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            timeline.mark(mark)

    return timed


def instrument(timeline: Timeline, state: ApiState) -> Callable[[], None]:
    """Wrap the route's steps with timers; the returned function unwraps them."""
    from services.api import deps

    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
        original = getattr(owner, attr)
        saved.append((owner, attr, original))
        setattr(owner, attr, wrapper(original))

    wrap(deps, "check_auth", lambda f: _sync_after(timeline, "auth", f))
    wrap(readmodel, "get_sandbox", lambda f: _after(timeline, "row", f))
    wrap(exec_route, "woken_for_http", lambda f: _after(timeline, "woken", f))
    wrap(state.use, "begin", lambda f: _after(timeline, "use", f))
    wrap(exec_route, "exec_environment", lambda f: _after(timeline, "env", f))
    driver = state.exec_driver
    assert driver is not None

    def stream(original: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def timed(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async with aclosing(original(*args, **kwargs)) as events:  # type: ignore[type-var]
                async for event in events:
                    timeline.mark("first")
                    yield event
            timeline.mark("last")

        return timed

    wrap(driver, "exec_stream", stream)
    if isinstance(driver, PodmanDriver):  # the driver's own steps
        wrap(driver.execs, "_listed", lambda f: _after(timeline, "lookup", f))
        wrap(podman_runc, "exec_process", lambda f: _sync_after(timeline, "spec", f))
        wrap(podman_runc._Run, "__init__", lambda f: _sync_after(timeline, "runc", f))
        wrap(podman_runc._Run, "decide", lambda f: _sync_after(timeline, "started", f))

    def undo() -> None:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)

    return undo


class AsgiMarks:
    """The request's arrival and its answer's start and end marked (an ASGI middleware)."""

    def __init__(self, app: Any, timeline: Timeline) -> None:
        self.app, self.timeline = app, timeline

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.timeline.mark("app")

        async def sending(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                self.timeline.mark("start")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self.timeline.mark("end")

        await self.app(scope, receive, sending)
