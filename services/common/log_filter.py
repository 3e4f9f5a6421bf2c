"""Rate-limited logging of the Kafka client: one line per message kind per window.

While a broker is unreachable, aiokafka logs the same connection error every retry (many a
second, per connection); this filter lets the first through and then one per ``window``
seconds with how many were left out, so a long outage cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

NOISY = ("aiokafka", "kafka")


class RateLimited(logging.Filter):
    def __init__(
        self,
        window: float = 30.0,
        loggers: tuple[str, ...] = NOISY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window, self.loggers, self.clock = window, loggers, clock
        self._last: dict[tuple[str, str], float] = {}
        self._left_out: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.loggers):
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.window:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return False
        self._last[key] = now
        left_out = self._left_out.pop(key, 0)
        if left_out:
            record.msg = f"{record.msg} [{left_out} more like it in {self.window:.0f}s not shown]"
        return True


def rate_limit_kafka_logs(window: float = 30.0) -> None:
    """Install the filter on the root logger's handlers (after ``logging.basicConfig``)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RateLimited(window))
