"""Serving concurrent asyncio callers with one batched call in a worker thread.

Many rollouts call ``act()`` at once; a model serves them far faster together than one by
one. The first request of a batch waits ``window`` seconds for others, then the batch (up to
``max_batch``; the rest form the next one) runs in a thread so the event loop keeps serving
sandboxes meanwhile. Results go back to each caller; an exception goes to every caller of
its batch. A caller that is cancelled only drops its own result.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Callable, Generic, Optional, TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")


class MicroBatcher(Generic[Request, Result]):
    def __init__(self, run: Callable[[list[Request]], list[Result]], *, window: float = 0.005,
                 max_batch: int = 32, executor: Optional[Executor] = None) -> None:
        """``executor``: where batches run (default: asyncio's default executor)."""
        if max_batch < 1 or window < 0:
            raise ValueError("max_batch must be >= 1 and window >= 0")
        self.run = run
        self.window = window
        self.max_batch = max_batch
        self.executor = executor
        self.pending: list[tuple[Request, asyncio.Future[Result]]] = []
        self.batches: list[int] = []  # size of each batch run, for tests and stats
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, request: Request) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        if len(self.pending) == 1:
            self._schedule()
        return await future

    def _schedule(self) -> None:
        task = asyncio.get_running_loop().create_task(self._flush())
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        await asyncio.sleep(self.window)
        batch, self.pending = self.pending[:self.max_batch], self.pending[self.max_batch:]
        if self.pending:
            self._schedule()
        live = [(request, future) for request, future in batch if not future.done()]
        if not live:
            return
        self.batches.append(len(live))
        try:
            results = await asyncio.get_running_loop().run_in_executor(self.executor, self.run,
                                                                       [request for request, _ in live])
            if len(results) != len(live):
                raise RuntimeError(f"a batch of {len(live)} requests gave {len(results)} results")
        except Exception as exc:
            for _, future in live:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(live, results):
            if not future.done():
                future.set_result(result)
