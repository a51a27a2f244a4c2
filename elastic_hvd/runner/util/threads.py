"""Horovod's ``horovod.runner.util.threads``, which Horovod's helpers import to run
functions in background threads (``--as-horovod`` maps that module here).  Any other
name raises an AttributeError that names it as a Horovod internal not provided.
"""

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner.util.threads")


def _check_args(args: object) -> None:
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}; for one argument use (arg,)")


def in_thread(target: Callable[..., Any], args: tuple[Any, ...] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a new thread and return the thread; ``silent``
    swallows any exception it raises."""
    _check_args(args)

    def run(*run_args: Any) -> None:
        try:
            target(*run_args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: tuple[Any, ...] = (),
             stop: threading.Event | None = None, check_stop_interval_s: float = 1.0,
             daemon: bool = True, silent: bool = False) -> threading.Thread:
    """In a new thread, call ``func(*args)`` once ``event`` is set -- unless ``stop``
    (looked at every ``check_stop_interval_s``) is set first.  A non-daemon thread
    needs ``stop``.  Returns the thread."""
    if event is None:
        raise ValueError("event must not be None")
    _check_args(args)
    if stop is None and not daemon:
        raise ValueError("a non-daemon event thread needs a stop event")

    def wait_then_call() -> None:
        if stop is None:
            event.wait()
        else:
            while not (event.wait(check_stop_interval_s) or stop.is_set()):
                pass
            if stop.is_set():
                return
        func(*args)

    return in_thread(wait_then_call, daemon=daemon, silent=silent)


def execute_function_multithreaded(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                                   block_until_all_done: bool = True,
                                   max_concurrent_executions: int = 1000) -> dict[int, Any] | None:
    """``fn(*args)`` for every ``args`` of ``args_list``, in at most
    ``max_concurrent_executions`` threads.  Blocking: returns ``{index in args_list:
    result}`` and raises RuntimeError if a call failed; else returns None at once."""
    todo: queue.Queue[tuple[int, Sequence[Any]]]
    results: dict[int, Any]
    todo, results = queue.Queue(), {}
    for index, args in enumerate(args_list):
        todo.put((index, args))

    def work() -> None:
        while True:
            try:
                index, args = todo.get_nowait()
            except queue.Empty:
                return
            results[index] = fn(*args)

    threads = [in_thread(work, daemon=not block_until_all_done)
               for _ in range(min(max_concurrent_executions, len(args_list)))]
    if not block_until_all_done:
        return None
    for thread in threads:
        thread.join()
    if len(results) != len(args_list):
        raise RuntimeError(f"some threads running {fn.__name__} did not complete")
    return results
