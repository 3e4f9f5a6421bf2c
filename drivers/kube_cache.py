"""The Kubernetes driver's own view of its Pods: one listing and one watch of the namespace's
sandstream Pods for the whole driver (an informer), instead of a listing and a watch per call.

A launch waits on it for its Pod to run, a stop for its Pod to go, and launch, stop and delete
read the key's Pods from it. Its answers can lag the API server by the watch's delay, so the
driver never trusts an "absent" it cannot confirm otherwise (docs/drivers.md, "Requests per
sandbox"): its own writes are noted at once (read-your-writes), a create that finds the name
taken answers 409, and an answer is re-read once the cache has caught up with a write of the
call's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final

from drivers.kube_api import TRANSPORT_ERRORS, ApiStatusError, Gone, KubeApi, describe
from drivers.kube_objects import PodView, read_pod, sort_views
from events.backoff import Backoff

log = logging.getLogger("sandstream.drivers.kubernetes")

# Uids of Pods seen deleted, so that a late answer of an earlier write cannot bring one back.
_TOMBSTONES: Final = 4096


def version_number(version: str) -> int | None:
    """A resourceVersion as a number (etcd's revision), None when it is not one."""
    try:
        return int(version)
    except ValueError:
        return None


class PodCache:
    """The namespace's sandstream Pods as one watch of them last showed them, by uid."""

    def __init__(self, api: KubeApi, reconnect_delay: float, max_reconnect_delay: float) -> None:
        self._api = api
        self._delays = (reconnect_delay, max_reconnect_delay)
        self._pods: dict[str, PodView] = {}
        # The same Pods by key, then uid: a call reads its key's Pods without a scan of all the
        # namespace's (thousands in a fleet, several reads a launch).
        self._by_key: dict[str, dict[str, PodView]] = {}
        self._gone: OrderedDict[str, PodView | None] = OrderedDict()  # uid -> its last view
        self.version = 0  # the last resourceVersion the watch delivered (or listed)
        self.listings = 0
        self._live = False  # listed, and the watch not broken since
        self._listed = asyncio.Event()
        # The waiters of ``until``, by the uid they wait on (None: any change): a change of one
        # Pod wakes its own waiters only, not every launch and delete waiting in a burst.
        self._waiters: dict[str | None, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    # -- reading -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def views(self, key: str, wait: float) -> list[PodView] | None:
        """The key's Pods, or None when the cache cannot answer (not listed within ``wait``
        seconds, or its watch is broken): the caller lists them itself."""
        self.start()
        if not self._listed.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._listed.wait()
        if not self._live:
            return None
        return sort_views(list(self._by_key.get(key, {}).values()))

    @property
    def live(self) -> bool:
        return self._live

    def pod(self, uid: str) -> PodView | None:
        return self._pods.get(uid)

    def last(self, uid: str) -> PodView | None:
        """A removed Pod's last view (its final status may carry the exit code)."""
        return self._gone.get(uid)

    async def until(self, done: Callable[[], bool], timeout: float, uid: str | None = None) -> bool:
        """Wait until ``done()`` holds after some change (True), or ``timeout`` passes (False,
        after a final check); with ``uid``, ``done`` reads that Pod only, and only its changes
        (and listings) wake the wait. The cache is trusted while it may be stale: a broken watch
        resumes from its version, so a change is late, never lost."""
        self.start()
        deadline = time.monotonic() + timeout
        woken = asyncio.Event()
        waiters = self._waiters.setdefault(uid, set())
        waiters.add(woken)
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return done()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await woken.wait()
                woken.clear()  # no await since the wake: a later change sets it again
            return True
        finally:
            waiters.discard(woken)
            if not waiters and self._waiters.get(uid) is waiters:
                del self._waiters[uid]

    # -- writing -----------------------------------------------------------------------------

    def note(self, view: PodView) -> None:
        """A Pod as one of the driver's own calls read or wrote it (read-your-writes): taken
        unless the cache already holds that version or a later one, or saw it removed."""
        if view.uid not in self._gone:
            self._apply(view)

    def note_gone(self, view: PodView) -> None:
        """A Pod the API server answered removed (a delete that took it at once)."""
        if view.uid not in self._gone:
            self._bury(view.uid, view)
            self._changed(view.uid)

    def _apply(self, view: PodView) -> None:
        held = self._pods.get(view.uid)
        new, old = version_number(view.resource_version), None
        if held is not None:
            old = version_number(held.resource_version)
        if new is None or old is None or new >= old:
            self._forget(view.uid)
            self._keep(view)
            self._changed(view.uid)

    def _keep(self, view: PodView) -> None:
        self._pods[view.uid] = view
        self._by_key.setdefault(view.info.key, {})[view.uid] = view

    def _forget(self, uid: str) -> None:
        """Drop ``uid`` from both maps (its key read from the view held: labels may change)."""
        held = self._pods.pop(uid, None)
        if held is None:
            return
        same = self._by_key.get(held.info.key)
        if same is not None:
            same.pop(uid, None)
            if not same:
                del self._by_key[held.info.key]

    def _bury(self, uid: str, last: PodView | None = None) -> None:
        self._gone[uid] = last or self._pods.get(uid)
        self._forget(uid)
        while len(self._gone) > _TOMBSTONES:
            self._gone.popitem(last=False)

    def _changed(self, uid: str | None = None) -> None:
        """Wake the waiters of ``uid`` and those of any change (None: every waiter)."""
        for key in (None, uid) if uid is not None else list(self._waiters):
            for woken in self._waiters.get(key, ()):
                woken.set()

    # -- the informer ------------------------------------------------------------------------

    def _listing(self, views: list[PodView], version: str) -> None:
        listed_version = version_number(version) or 0
        # Kept: Pods the driver's own writes noted later than this listing.
        kept = {
            uid: v
            for uid, v in self._pods.items()
            if (version_number(v.resource_version) or 0) > listed_version
        }
        for uid in set(self._pods) - {v.uid for v in views} - set(kept):
            self._bury(uid)
        self._pods, self._by_key = {}, {}
        for view in [*views, *kept.values()]:  # a kept view replaces a listed one
            self._forget(view.uid)
            self._keep(view)
        self.version = listed_version
        self.listings += 1
        self._live = True
        self._listed.set()
        self._changed()

    def _event(self, kind: str, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        number = version_number(str(meta.get("resourceVersion", "")))
        if number is not None:
            self.version = max(self.version, number)
        self._live = True
        if kind == "BOOKMARK":
            self._changed()
            return
        view = read_pod(pod)
        if view is None:
            return
        if kind == "DELETED":
            self._bury(view.uid, view)
            self._changed(view.uid)
        elif view.uid not in self._gone:
            self._apply(view)

    async def _run(self) -> None:
        backoff = Backoff(*self._delays, log, "kubernetes pod cache")
        version: str | None = None
        while True:
            try:
                if version is None:
                    views, version = await self._api.list_all()
                    self._listing(views, version)
                async with contextlib.aclosing(self._api.watch_pods(version, count=False)) as ev:
                    async for kind, pod in ev:
                        backoff.succeeded()
                        self._event(kind, pod)
                        version = str(pod.get("metadata", {}).get("resourceVersion") or version)
                backoff.succeeded()
            except Gone:
                version = None
            except (*TRANSPORT_ERRORS, ApiStatusError) as exc:
                self._live = False
                await asyncio.sleep(backoff.failed(describe(exc)))
            except Exception as exc:  # never a dead cache that still answers
                self._live = False
                log.exception("kubernetes pod cache failed; listing again")
                version = None
                await asyncio.sleep(backoff.failed(repr(exc)))
