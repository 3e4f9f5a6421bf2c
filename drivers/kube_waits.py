"""Waiting on one Pod of the Kubernetes driver until a condition holds (it runs, it is gone),
and deleting it with its grace period, then waiting until it is gone. The driver's Pod cache
(drivers/kube_cache.py) answers while it is live; without it, a watch of that one Pod does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

from drivers.kube_api import Gone, KubeApi
from drivers.kube_cache import PodCache
from drivers.kube_objects import PodView, read_pod
from drivers.protocol import DriverError, observed_state


class Deadline(Exception):
    """The awaited condition did not hold by the deadline."""

    def __init__(self, last: PodView | None) -> None:
        super().__init__("still present")
        self.last = last


async def await_pod(
    api: KubeApi,
    view: PodView,
    until: Callable[[PodView | None], bool],
    timeout: float,
    cache: PodCache | None = None,
) -> tuple[PodView | None, PodView]:
    """Wait until ``until`` holds for the Pod (None once it is gone): on the cache while it
    is live, else following a watch of that one Pod, re-read and watched again whenever a
    watch ends. Returns the Pod's view (None: gone) and the last view of it seen; Deadline at
    the deadline."""
    if cache is not None and cache.live:
        return await _await_cached(cache, view, until, timeout)
    deadline = time.monotonic() + timeout
    current: PodView | None = view
    last = view
    while not until(current):
        remaining = deadline - time.monotonic()
        if current is None or remaining <= 0:
            raise Deadline(current)
        events = api.watch_pods(
            current.resource_version,
            field_selector=f"metadata.name={view.name}",
            timeout_seconds=max(1, math.ceil(remaining)),
        )
        with contextlib.suppress(Gone, TimeoutError):
            async with asyncio.timeout(remaining), contextlib.aclosing(events):
                async for kind, pod in events:
                    seen = read_pod(pod)
                    if kind == "BOOKMARK" or seen is None or seen.uid != view.uid:
                        continue
                    last = seen
                    current = None if kind == "DELETED" else seen
                    if until(current):
                        return current, last
        if current is not None:
            fresh = await api.fetch_pod(view.name)
            seen = read_pod(fresh) if fresh else None
            current = seen if seen is not None and seen.uid == view.uid else None
            last = current or last
    return current, last


async def _await_cached(
    cache: PodCache, view: PodView, until: Callable[[PodView | None], bool], timeout: float
) -> tuple[PodView | None, PodView]:
    cache.note(view)
    last = view

    def current() -> PodView | None:
        nonlocal last
        seen = cache.pod(view.uid)
        last = seen or cache.last(view.uid) or last
        return seen

    if not await cache.until(lambda: until(current()), timeout, view.uid):
        raise Deadline(current() or last)
    return current(), last


async def remove_pod(
    api: KubeApi, view: PodView, grace: float, margin: float, cache: PodCache | None = None
) -> PodView | None:
    """Delete the Pod with ``grace`` and wait until it is gone (up to ``margin`` past the
    grace period): its last view (a deleted Pod's final status may carry the exit code), or
    None when it was already gone. Still there then: a retryable DriverError."""
    deleted = await api.delete_object("pods", view.name, view.uid, grace=math.ceil(grace))
    if deleted is None:
        return None
    limit = grace + margin
    if cache is not None and cache.live:
        # The cache's watch sees the removal whenever it happens (even at once): no read back.
        answered = read_pod(deleted)
        if answered is None:  # a Status: gone at once
            cache.note_gone(view)
            return view
        return await _awaited_removal(answered, limit, cache)
    # Read it back: a delete without grace (or of an unscheduled Pod) removes it at once, and
    # a watch from the delete's answer would not see that removal again.
    fresh = await api.fetch_pod(view.name)
    current = read_pod(fresh) if fresh else None
    if current is None or current.uid != view.uid:
        return read_pod(deleted) or view
    return await _awaited_removal(current, limit, api)


async def _awaited_removal(view: PodView, limit: float, via: KubeApi | PodCache) -> PodView:
    try:
        if isinstance(via, PodCache):
            _, last = await _await_cached(via, view, lambda v: v is None, limit)
        else:
            _, last = await await_pod(via, view, lambda v: v is None, limit)
    except Deadline as exc:
        still = exc.last or view
        raise DriverError(
            f"pod {view.name} still terminating {limit:.0f}s after its deletion "
            "(a finalizer, or an unreachable node)",
            retryable=True,
            observed=observed_state(still.info.state),
            exit_code=still.info.exit_code,
        ) from None
    return last
