"""Independent harness runs side by side: one function over argument tuples, in spawned worker processes."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable


def run_parallel(fn: Callable[..., Any], calls: list[tuple], jobs: int = 1) -> list[Any]:
    """`fn(*args)` for every tuple in `calls`, results in their order; `jobs` at a time in worker processes, spawned
    so that no torch state (threads, seeds, modules) is shared. `fn` must be importable (module level)."""
    if jobs <= 1:
        return [fn(*args) for args in calls]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        return [f.result() for f in futures]
