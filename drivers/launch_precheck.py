"""The launch rules every driver keeps, as one pure function over the runtimes of the key the
driver observed: what a launch removes first, which runtime it adopts, and when it refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from drivers.protocol import DriverError, LaunchSpec, RuntimeInfo, observed_state


class Seen(Protocol):
    """A runtime as a driver read it back."""

    @property
    def info(self) -> RuntimeInfo: ...

    @property
    def terminating(self) -> bool:
        """Its removal is under way (a Kubernetes Pod with a deletion timestamp)."""
        ...


R = TypeVar("R", bound=Seen)


@dataclass(frozen=True, slots=True)
class LaunchPlan(Generic[R]):
    """What a launch does: stop and remove ``replace`` (with their own grace periods), then
    raise ``refusal`` if there is one, else adopt ``current`` (None: create the runtime)."""

    replace: tuple[R, ...]
    current: R | None
    refusal: DriverError | None = None

    @property
    def starts(self) -> bool:
        """Whether the launch starts the runtime (False: it runs already, an idempotent
        repeat)."""
        return self.current is None or self.current.info.state == "created"


def launch_precheck(spec: LaunchSpec, seen: Sequence[R]) -> LaunchPlan[R]:
    """The launch rules over the key's runtimes (any order):

    - a runtime of a *newer* generation: refused at once ("superseded": a replayed old intent
      must not start a second runtime), nothing removed;
    - runtimes of older generations are replaced; so is one of this generation that is being
      removed (a stop raced the launch) or was launched for another identity or incarnation
      (cannot happen through the processor, which mints both together: the persisted one
      wins);
    - this generation's runtime that ran and exited: refused once the older ones are gone ("a
      generation never runs twice": a redelivered launch must not resurrect a generation the
      row has moved past; a new run is a new generation);
    - otherwise this generation's runtime, if any, is adopted.
    """
    ordered = sorted(seen, key=lambda r: (r.info.generation, r.info.runtime_id))
    newer = [r.info for r in ordered if r.info.generation > spec.generation]
    if newer:
        newest = newer[-1]
        refusal = DriverError(
            f"launch of generation {spec.generation} superseded: generation "
            f"{newest.generation} of {spec.key} exists",
            retryable=False,
            observed=observed_state(newest.state),
            exit_code=newest.exit_code,
        )
        return LaunchPlan((), None, refusal)
    replace: list[R] = []
    current: R | None = None
    for runtime in ordered:
        info = runtime.info
        if (
            info.generation < spec.generation
            or runtime.terminating
            or info.identity != spec.identity
            or info.sandbox_id != spec.sandbox_id
        ):
            replace.append(runtime)
        else:
            current = runtime
    if current is not None and current.info.state == "exited":
        refusal = DriverError(
            f"generation {spec.generation} of {spec.key} already ran and exited: a launch "
            "never starts it again",
            retryable=False,
            observed="exited",
            exit_code=current.info.exit_code,
        )
        return LaunchPlan(tuple(replace), None, refusal)
    return LaunchPlan(tuple(replace), current)
