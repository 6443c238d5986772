"""Sampling continuations of exact token contexts from a causal LM, several contexts at once.

Contexts of different lengths are left-padded into one batch (attention mask 0 on the pads,
position ids counted from each context's first real token), prefilled once, then decoded
one token per step with the model's KV cache. Each row stops at a stop token or at its
own ``max_tokens``; rows are independent, so what a finished row is fed does not matter.

Log-probs are those of the *raw* model (log_softmax of the logits, before temperature and
top-p), i.e. of the policy at temperature 1: what a GRPO trainer recomputes for its
importance ratios. The sampler itself draws from the temperature-scaled, top-p-truncated
distribution (temperature 0: greedy).

A seeded sampler draws a *keyed* request (``SampleRequest.key``: its rollout and turn) from a
generator of its own, seeded from (seed, key): what a rollout samples then does not depend on
which requests shared its batch or in which order concurrent rollouts reached the model.
Unkeyed requests share the sampler's one generator.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from orchard.rollout.policy import FinishReason


@dataclass
class SampleRequest:
    tokens: list[int]  # the exact context, never empty
    max_tokens: int
    key: str = ""  # names this draw (e.g. "TASK/ATTEMPT/TURN"): with a seed, its own generator


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # raw-model log-prob of each sampled token
    finish_reason: FinishReason


class Sampler:
    """Callable on a batch of requests; one batch runs at a time (a thread lock guards the model)."""

    def __init__(self, model: Any, *, stop_ids: frozenset[int], pad_id: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None, device: Optional[torch.device | str] = None) -> None:
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        self.model = model
        self.stop_ids = stop_ids
        self.pad_id = pad_id
        self.temperature = temperature
        self.top_p = top_p
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.seed = seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        parameters = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"  # transformers 5.x renamed it
        self.keep_last = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in parameters), None)
        self.lock = threading.Lock()
        self.forward_calls = 0

    def __call__(self, requests: list[SampleRequest]) -> list[Sample]:
        if any(not r.tokens for r in requests):
            raise ValueError("cannot sample from an empty context")
        with self.lock, torch.no_grad(), _eval_mode(self.model):
            return self._sample(requests)

    def _sample(self, requests: list[SampleRequest]) -> list[Sample]:
        rows, width = len(requests), max(len(r.tokens) for r in requests)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, width - len(request.tokens):] = torch.tensor(request.tokens, dtype=torch.long)
            mask[row, width - len(request.tokens):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        sampled: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[FinishReason] = ["length"] * rows
        done = [r.max_tokens <= 0 for r in requests]
        generators = [self._keyed(r.key) for r in requests]
        cache = None
        while not all(done):
            kwargs = {self.cache_name: cache, self.keep_last: 1} if self.keep_last else {self.cache_name: cache}
            output = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
            self.forward_calls += 1
            cache = getattr(output, self.cache_name)
            logits = output.logits[:, -1, :].float()
            chosen = self._choose(logits, generators)
            chosen_logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None]).squeeze(1)
            for row, (token, logprob) in enumerate(zip(chosen.tolist(), chosen_logprobs.tolist())):
                if done[row]:
                    continue
                sampled[row].append(token)
                logprobs[row].append(logprob)
                if token in self.stop_ids:
                    done[row], finish[row] = True, "stop"
                elif len(sampled[row]) >= requests[row].max_tokens:
                    done[row] = True
            ids = chosen[:, None]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
        return [Sample(s, lp, f) for s, lp, f in zip(sampled, logprobs, finish)]

    def _keyed(self, key: str) -> Optional[torch.Generator]:
        """A keyed request's own generator (None: the shared one)."""
        if not key or self.seed is None:
            return None
        digest = hashlib.blake2b(f"{self.seed}/{key}".encode(), digest_size=8).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest, "little") >> 1)

    def _choose(self, logits: torch.Tensor, generators: list[Optional[torch.Generator]]) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > self.top_p  # mass before it already covers top_p
            probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
        if all(g is None for g in generators):
            return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        # each keyed row from its own generator; a finished row still draws (and is ignored),
        # so a row's n-th token always takes its generator's n-th draw
        return torch.cat([torch.multinomial(row, 1, generator=g if g is not None else self.generator)
                          for row, g in zip(probs, generators)])


@contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Sample without dropout, and hand a model shared with a trainer back in its own mode."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
