"""How the policy that generates rollouts gets the trainer's new weights.

In process (``SharedModel``) the policy samples from the very model the trainer updates:
nothing moves. With an inference server (vLLM, SGLang) the trainer saves the weights where
the server can read them and asks it to load them (``ServerReload``): SGLang serves
``POST /update_weights_from_disk`` with ``{"model_path": DIR}``; vLLM needs a reload hook of
its own deployment (e.g. a ``collective_rpc`` route in dev mode) given as ``url``. The
trainer calls ``push`` after every optimizer step that changed the weights.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Optional

import httpx


class WeightSync(ABC):
    @abstractmethod
    async def push(self, model: Any, step: int) -> None:
        """Make the rollout policy sample from ``model``'s current weights."""


class SharedModel(WeightSync):
    """The policy holds the trainer's own model object (``HuggingFacePolicy(model, ...)``)."""

    async def push(self, model: Any, step: int) -> None:
        return None


class ServerReload(WeightSync):
    """Save to ``directory`` (shared with the server), then POST ``{body_key: path}`` to ``url``."""

    def __init__(self, url: str, directory: Path, body_key: str = "model_path", tokenizer: Optional[Any] = None,
                 timeout: float = 600.0, api_key: Optional[str] = None) -> None:
        self.url, self.directory, self.body_key = url, Path(directory), body_key
        self.tokenizer, self.timeout, self.api_key = tokenizer, timeout, api_key

    async def push(self, model: Any, step: int) -> None:
        target = self.directory / f"step-{step}"
        await asyncio.to_thread(model.save_pretrained, target)
        if self.tokenizer is not None:
            await asyncio.to_thread(self.tokenizer.save_pretrained, target)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            answer = await client.post(self.url, json={self.body_key: str(target)}, headers=headers)
        if answer.status_code >= 400:
            raise RuntimeError(f"the inference server refused the new weights ({answer.status_code}): "
                               f"{answer.text[:500]}")
