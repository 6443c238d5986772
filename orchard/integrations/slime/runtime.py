"""One process-wide Orchard runtime behind slime's plain function calls.

slime calls the rollout function synchronously and the reward function on its own event
loop, once per step, many times; sandboxes, prepared task states, the HTTP client and
BAR's adaptive band must outlive each call. So one :class:`SlimeRuntime` owns them on a
private event-loop thread (the sync SDK's portal); slime's threads and loops hand it
coroutines. It is built on first use from ``$ORCHARD_SLIME_CONFIG`` and slime's ``args``,
or by :func:`configure` (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Optional, TypeVar

from orchard.client.aio import AsyncClient
from orchard.client.sync import Portal
from orchard.integrations.slime.samples import set_sample_class
from orchard.integrations.slime.settings import SlimeSettings
from orchard.integrations.slime.sglang import SGLangPolicy
from orchard.rollout.engine import RolloutEngine
from orchard.rollout.loop import task_messages
from orchard.rollout.policy import Policy
from orchard.tasks import Task
from orchard.train.bar import AdaptiveBand, Selection, bar_sample

T = TypeVar("T")
_RUNTIME: Optional["SlimeRuntime"] = None
_LOCK = threading.Lock()


def load_tokenizer(args: Any) -> Any:
    """The served model's tokenizer (``--hf-checkpoint``), as slime loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)


class SlimeRuntime:
    def __init__(self, settings: SlimeSettings, args: Any, tokenizer: Any = None,
                 policy: Optional[Policy] = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args)
        self.policy = policy or SGLangPolicy(
            settings.router(args), self.tokenizer, temperature=getattr(args, "rollout_temperature", 1.0),
            top_p=getattr(args, "rollout_top_p", 1.0), top_k=getattr(args, "rollout_top_k", -1),
            max_concurrency=settings.max_concurrent)
        self.band = AdaptiveBand(settings.band(), settings.bar(1)) if settings.adaptive_band else None
        self.portal = Portal()
        self.client: AsyncClient = self.call(self._client())
        self.engine = RolloutEngine(self.client, self.policy, settings.engine(args))

    async def _client(self) -> AsyncClient:
        s = self.settings
        if s.server_url:
            return AsyncClient(s.server_url, s.api_key)
        return AsyncClient(backend=s.backend, backend_settings=s.backend_settings)

    def call(self, step: Awaitable[T]) -> T:
        """Run ``step`` on the runtime's loop from a plain thread (slime's rollout function)."""
        return self.portal.call(step)

    async def run(self, step: Awaitable[T]) -> T:
        """Await ``step`` on the runtime's loop from another event loop (slime's reward function)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(step, self.portal.loop))  # type: ignore[arg-type]

    async def select(self, task: Task, group_size: int) -> Selection:
        """BAR for one prompt: a group of ``group_size`` from forks of the task's prepared state."""
        generate = self.engine.generator(task)
        config = self.settings.bar(group_size)
        if self.band is not None:
            self.band.config = config
            return await self.band.sample(task.task_id, generate)
        return await bar_sample(generate, config)

    def prompt_tokens(self, task: Task) -> list[int]:
        """The first request's tokens for ``task`` (what a zero-weight slot of its group holds)."""
        template = getattr(self.policy, "template", None)
        return template.prompt(task_messages(task, self.engine.config.rollout)) if template is not None else []

    @property
    def pad_id(self) -> int:
        """The token an empty response gets (mask 0): end of sequence, else padding, else 0."""
        for value in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id):
            if value is not None:
                return int(value)
        return 0

    def close(self) -> None:
        async def shut() -> None:
            await self.engine.close()
            await self.policy.close()
            await self.client.close()

        self.call(shut())
        self.portal.close()


def configure(settings: Optional[SlimeSettings] = None, args: Any = None, *, tokenizer: Any = None,
              policy: Optional[Policy] = None, sample_class: Optional[type] = None) -> SlimeRuntime:
    """Build the process's runtime now (replacing one that exists)."""
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is not None:
            _RUNTIME.close()
        if sample_class is not None:
            set_sample_class(sample_class)
        _RUNTIME = SlimeRuntime(settings or SlimeSettings.load(), args, tokenizer, policy)
        return _RUNTIME


def runtime(args: Any) -> SlimeRuntime:
    """The process's runtime, built from ``$ORCHARD_SLIME_CONFIG`` and ``args`` on first use."""
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is None:
            _RUNTIME = SlimeRuntime(SlimeSettings.load(), args)
        return _RUNTIME


def shutdown() -> None:
    """Delete every sandbox and snapshot and stop the runtime's loop."""
    global _RUNTIME
    with _LOCK:
        if _RUNTIME is not None:
            _RUNTIME.close()
        _RUNTIME = None
