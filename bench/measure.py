"""Measurements the benchmarks share."""

from __future__ import annotations

from typing import Callable


def peak_allocated_mib(fn: Callable[[], object]) -> float:
    """Peak tensor memory (MiB) that ``fn()`` allocates above the level before it: the PyTorch
    profiler's allocation and free events in time order, running sum, maximum."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak / 2**20
