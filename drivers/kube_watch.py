"""What the Kubernetes driver's watch stream reports of each Pod: listings and watch events
turned into observations, each change once, a Pod missing from a relisting as removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from drivers.kube_objects import ACTOR, PodView, Shape, read_pod, removed, shape, snapshot
from drivers.protocol import WatchObservation


@dataclass
class Reported:
    """The Pods one watch stream has reported, and what it last reported of each."""

    actor: str = ACTOR
    known: dict[str, tuple[str, int]] = field(default_factory=dict)  # uid -> (key, generation)
    shapes: dict[str, Shape] = field(default_factory=dict)  # uid -> what was last reported

    def listed(self, views: Iterable[PodView]) -> list[WatchObservation]:
        """A full listing: a snapshot of every Pod, then the removal of each Pod reported
        before and missing now (it went while the stream was away)."""
        views = list(views)
        out: list[WatchObservation] = []
        listed = {v.uid: (v.info.key, v.info.generation) for v in views}
        for view in views:
            self.shapes[view.uid] = shape(view)
            out.append(snapshot(view, source="list", actor=self.actor))
        for uid, (key, generation) in self.known.items():
            if uid not in listed:
                self.shapes.pop(uid, None)
                out.append(removed(key, generation, uid, resource_version=None, actor=self.actor))
        self.known = listed
        return out

    def observe(self, kind: str, pod: Mapping[str, Any]) -> list[WatchObservation]:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``): a snapshot when what the
        fold knows of the Pod changed, a removal (after its exit, if that is news) when it
        was deleted; nothing for a Pod that is not ours."""
        view = read_pod(pod)
        if view is None:
            return []
        out: list[WatchObservation] = []
        if kind == "DELETED":
            if view.info.state == "exited" and self.shapes.get(view.uid, ("",))[0] != "exited":
                # The final status carried the exit: report it before the removal.
                out.append(snapshot(view, source="watch", actor=self.actor))
            self.known.pop(view.uid, None)
            self.shapes.pop(view.uid, None)
            out.append(
                removed(
                    view.info.key,
                    view.info.generation,
                    view.uid,
                    resource_version=view.resource_version,
                    actor=self.actor,
                    now=datetime.now(UTC),
                )
            )
            return out
        self.known[view.uid] = (view.info.key, view.info.generation)
        if self.shapes.get(view.uid) != shape(view):
            self.shapes[view.uid] = shape(view)
            out.append(snapshot(view, source="watch", actor=self.actor))
        return out
