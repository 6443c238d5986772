"""This process's memory, for reports and metrics: where a run's peak comes from shows there."""

from __future__ import annotations

import os
import resource


def memory_mb() -> dict[str, int]:
    """Resident memory now and the peak so far, in MB (``rss_mb``, ``peak_rss_mb``)."""
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss_mb": resident >> 20, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}
