"""A thread pool whose threads never hold up the process's exit.

``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter exits, so a
call blocked in a backend (a Podman stop waiting out a long grace period) keeps a process
that has closed its driver alive until the backend answers. Calls submitted here run in
daemon threads instead, at most ``max_workers`` at once (the rest wait for a slot): once the
pool is shut down nothing waits for them, and the backend carries on with what it was asked
by itself.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class DaemonThreadPool(Executor):
    """An ``Executor`` running each call in a daemon thread of its own."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._slots = threading.BoundedSemaphore(max_workers)
        self._prefix = thread_name_prefix
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._queued: set[Future[Any]] = set()  # submitted, not yet holding a slot
        self._threads: set[threading.Thread] = set()
        self._shut_down = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        thread = threading.Thread(
            target=self._run,
            args=(future, fn, args, kwargs),
            name=f"{self._prefix}_{next(self._numbers)}",
            daemon=True,
        )
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queued.add(future)
            self._threads.add(thread)
        thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut_down = True
            queued = set(self._queued) if cancel_futures else set()
            threads = set(self._threads)
        for future in queued:
            future.cancel()  # a no-op for a call that got its slot meanwhile
        if wait:
            for thread in threads:
                thread.join()

    def _run(
        self,
        future: Future[T],
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        try:
            with self._slots:
                with self._lock:
                    self._queued.discard(future)
                if not future.set_running_or_notify_cancel():
                    return  # cancelled while it waited for a slot
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the caller gets it, as from any executor
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
