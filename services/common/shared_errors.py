"""One error handed to many waiters (a statement or query whose result several tasks share).

One exception object raised in many tasks gathers each task's frames on its one traceback, so a
waiter's logged traceback could show another waiter's code (a CI failure's log pointed at a
retried read, not the unretried one). Each waiter raises its own copy instead, caused by it.
"""

from __future__ import annotations

import copy


def own_copy(exc: BaseException) -> BaseException:
    """A copy of ``exc`` for one waiter, with ``exc`` as its cause (``exc`` itself when it cannot
    be copied: shared, as before)."""
    try:
        mine = copy.copy(exc)
    except Exception:
        return exc
    mine.__cause__ = exc
    return mine
