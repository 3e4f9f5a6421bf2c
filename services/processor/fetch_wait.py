"""How long the processor's fetches may wait at the broker: short only while one would delay.

A fetch returns as soon as any partition in it has a record, so its wait costs no latency when
every assigned partition is in it. aiokafka holds back the next fetch while a partition's
records are buffered (not yet taken by a poll) for its prefetch back-off (100 ms), then sends
it without that partition, and sends no other fetch to that broker while one is in flight: the
left-out partition's next records then wait for the fetch in flight to return. So the fetch's
wait is ``busy_ms`` while some partition's records are buffered and ``idle_ms`` when none is
(nothing left out): an idle processor fetches about twice a second instead of ten times, and
a busy one as before.

aiokafka has no option for this: it reads ``_fetch_max_wait_ms`` each time it builds the
fetches, in ``_get_actions_per_node``, which is wrapped here (aiokafka is pinned;
tests/test_fetch_wait.py checks the waits of the fetches a real consumer sends).
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer


def adapt_fetch_wait(consumer: AIOKafkaConsumer, busy_ms: int, idle_ms: int) -> None:
    """Make the started ``consumer`` wait ``idle_ms`` at the broker when no partition's records
    are buffered, ``busy_ms`` when some are."""
    fetcher: Any = consumer._fetcher
    build = fetcher._get_actions_per_node

    def actions_per_node(assignment: Any) -> Any:
        fetcher._fetch_max_wait_ms = busy_ms if fetcher._records else idle_ms
        return build(assignment)

    fetcher._get_actions_per_node = actions_per_node
