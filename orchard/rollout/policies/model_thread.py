"""One worker thread for in-process model work: sampling batches and training updates.

On the default executor each call may land on another thread, and glibc gives each thread
its own malloc arena; tensors of changing shapes then leave every arena at its own high-water
mark, and the process grows. Measured with the pipeline's 0.5M-parameter model, sampling batches
of changing shapes and an update every fifth (docs/results.md): after 20 batches RSS was
1,255 MB on the default executor's threads (1,886 MB after 100, still growing) and 747 MB
on one thread. Calls on one model are
serialized anyway (the sampler's lock; an update and a sampling batch never overlap), so one
thread costs no parallelism.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

Result = TypeVar("Result")

_lock = threading.Lock()
_executor: Optional[ThreadPoolExecutor] = None


def model_executor() -> ThreadPoolExecutor:
    """The process's model thread (made on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-model")
        return _executor


async def on_model_thread(function: Callable[..., Result], *args: Any) -> Result:
    """``function(*args)`` on the model thread, awaited without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(model_executor(), function, *args)
