"""Horovod's ``horovod.runner.util.threads``, which Horovod's helpers import to run
functions in background threads (``--as-horovod`` maps that module here).  Any other
name raises an AttributeError that names it as a Horovod internal not provided.
"""

import queue
import threading

from ...horovod_alias import not_provided

__getattr__ = not_provided("horovod.runner.util.threads")


def _check_args(args):
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}; for one argument use (arg,)")


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` in a new thread and return the thread; ``silent``
    swallows any exception it raises."""
    _check_args(args)

    def run(*run_args):
        try:
            target(*run_args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event, func, args=(), stop=None, check_stop_interval_s=1.0, daemon=True,
             silent=False):
    """In a new thread, call ``func(*args)`` once ``event`` is set -- unless ``stop``
    (looked at every ``check_stop_interval_s``) is set first.  A non-daemon thread
    needs ``stop``.  Returns the thread."""
    if event is None:
        raise ValueError("event must not be None")
    _check_args(args)
    if stop is None and not daemon:
        raise ValueError("a non-daemon event thread needs a stop event")

    def wait_then_call():
        if stop is None:
            event.wait()
        else:
            while not (event.wait(check_stop_interval_s) or stop.is_set()):
                pass
            if stop.is_set():
                return
        func(*args)

    return in_thread(wait_then_call, daemon=daemon, silent=silent)


def execute_function_multithreaded(fn, args_list, block_until_all_done=True,
                                   max_concurrent_executions=1000):
    """``fn(*args)`` for every ``args`` of ``args_list``, in at most
    ``max_concurrent_executions`` threads.  Blocking: returns ``{index in args_list:
    result}`` and raises RuntimeError if a call failed; else returns None at once."""
    todo, results = queue.Queue(), {}
    for index, args in enumerate(args_list):
        todo.put((index, args))

    def work():
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
