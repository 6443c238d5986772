"""MicroBatcher: concurrent callers served by one call in a thread, errors to every caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orchard.rollout.policies.batching import MicroBatcher


def test_concurrent_requests_share_one_call_and_get_their_own_results():
    threads = []

    def run(requests):
        threads.append(threading.current_thread())
        return [r * 10 for r in requests]

    batcher = MicroBatcher(run, window=0.01)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in range(4)))

    assert asyncio.run(main()) == [0, 10, 20, 30]
    assert batcher.batches == [4]
    assert threads[0] is not threading.main_thread()  # the event loop stays free while the model runs


def test_batches_are_capped_and_the_rest_follow():
    batcher = MicroBatcher(lambda requests: list(requests), window=0.005, max_batch=2)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in range(5)))

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    assert batcher.batches == [2, 2, 1]


def test_sequential_requests_run_one_by_one():
    batcher = MicroBatcher(lambda requests: [r + 1 for r in requests], window=0)

    async def main():
        return [await batcher.submit(1), await batcher.submit(2)]

    assert asyncio.run(main()) == [2, 3]
    assert batcher.batches == [1, 1]


def test_an_error_reaches_every_caller_of_its_batch():
    def run(requests):
        raise ValueError("model exploded")

    batcher = MicroBatcher(run, window=0.005)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, ValueError) and "exploded" in str(r) for r in results)


def test_a_wrong_number_of_results_is_an_error():
    batcher = MicroBatcher(lambda requests: [], window=0)
    with pytest.raises(RuntimeError, match="1 requests gave 0 results"):
        asyncio.run(batcher.submit(1))


def test_a_cancelled_caller_does_not_disturb_the_others():
    batcher = MicroBatcher(lambda requests: list(requests), window=0.02)

    async def main():
        doomed = asyncio.ensure_future(batcher.submit("doomed"))
        kept = asyncio.ensure_future(batcher.submit("kept"))
        await asyncio.sleep(0)
        doomed.cancel()
        return await kept, doomed.cancelled()

    assert asyncio.run(main()) == ("kept", True)
    assert batcher.batches == [1]
