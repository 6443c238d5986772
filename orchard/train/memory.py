"""This process's memory, for reports and metrics: where a run's peak comes from shows there."""

from __future__ import annotations

import os
import resource


def memory_mb() -> dict[str, int]:
    """Resident memory now and the peak so far, in MB (``rss_mb``, ``peak_rss_mb``). The kernel
    keeps both from per-CPU counters read at different times, so the peak it reports can trail
    the current figure by a few pages: the peak is never given as less than now."""
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10, resident)
    return {"rss_mb": resident >> 20, "peak_rss_mb": peak >> 20}
