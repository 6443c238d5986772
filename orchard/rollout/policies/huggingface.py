"""A Hugging Face causal LM in this process as a token-level policy (for small models, tests, and
RL where trainer and sampler share one model).

Token bookkeeping (see :mod:`orchard.rollout.policy`): ``begin`` renders the task's
messages with the chat template and the generation prompt (mask 0). ``act`` samples from
the exact token context (the conversation is never re-rendered) and appends the sampled
tokens with mask 1 (the end-of-turn token included when the model sampled it), then the
template's close of the turn with mask 0 (all of it, end-of-turn token included, when the
turn was cut at ``max_tokens``). ``observe`` appends a user message and the generation
prompt as the template renders them (mask 0); see :mod:`.chat_template`.

Log-probs are of the raw model at temperature 1 whatever the sampling temperature and
top-p: what the trainer recomputes (see :mod:`.sampling`). Concurrent ``act()`` calls are
batched (:mod:`.batching`) and run on the model thread (:mod:`.model_thread`), one batch at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from orchard.rollout.policies.batching import MicroBatcher
from orchard.rollout.policies.chat_template import ChatTemplateTokens
from orchard.rollout.policies.model_thread import model_executor
from orchard.rollout.policies.sampling import Sample, SampleRequest, Sampler
from orchard.rollout.policy import Context, Generation, Policy


class HuggingFacePolicy(Policy):
    name = "huggingface"

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_context_tokens: Optional[int] = None, device: Any = None, seed: Optional[int] = None,
                 batch_window: float = 0.005, max_batch: int = 32,
                 chat_template_kwargs: Optional[dict[str, Any]] = None) -> None:
        """``max_context_tokens``: a turn never takes the context past it (default: the model's
        ``max_position_embeddings``). ``device``: where inputs go (default: the model's first
        parameter's). ``seed``: a private generator, so a run is reproducible.
        ``batch_window``: how long a turn waits for concurrent turns to share its batch."""
        self.model = model
        self.tokenizer = tokenizer
        self.template = ChatTemplateTokens(tokenizer, extra_stop_ids=_generation_eos_ids(model),
                                           template_kwargs=chat_template_kwargs)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.sampler = Sampler(model, stop_ids=self.template.stop_ids, pad_id=pad if pad is not None else 0,
                               temperature=temperature, top_p=top_p, seed=seed, device=device)
        self.batcher: MicroBatcher[SampleRequest, Sample] = MicroBatcher(self.sampler, window=batch_window,
                                                                         max_batch=max_batch,
                                                                         executor=model_executor())
        self.max_context_tokens = max_context_tokens or getattr(model.config, "max_position_embeddings", None)

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], *, dtype: str = "auto", device: Optional[str] = None,
                        **settings: Any) -> "HuggingFacePolicy":
        """Load a model and its tokenizer from a local directory (or a hub id, when allowed)."""
        import transformers
        from packaging.version import Version

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        dtype_name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **{dtype_name: dtype})
        if device is not None:
            model.to(device)
        return cls(model, tokenizer, device=device, **settings)

    def state_dict(self) -> Any:
        generator = self.sampler.generator
        return generator.get_state() if generator is not None else None

    def load_state_dict(self, state: Any) -> None:
        if state is not None and self.sampler.generator is not None:
            self.sampler.generator.set_state(state)

    async def begin(self, messages: list[dict[str, str]]) -> Context:
        context = Context(messages=[dict(m) for m in messages])
        context.append(self.template.prompt(messages))
        context.prompt_length = len(context.tokens)
        return context

    async def act(self, context: Context, max_tokens: int) -> Generation:
        budget = max_tokens
        if self.max_context_tokens is not None:
            budget = min(budget, self.max_context_tokens - len(context.tokens))
        if budget <= 0:  # the context is full: an empty turn cut at its length
            context.messages.append({"role": "assistant", "content": ""})
            return Generation(text="", finish_reason="length")
        # keyed by rollout and turn: a seeded run samples the same whatever ran beside it
        key = f"{context.rollout}/{sum(m['role'] == 'assistant' for m in context.messages)}" if context.rollout else ""
        sample = await self.batcher.submit(SampleRequest(list(context.tokens), budget, key))
        context.append(sample.token_ids, sample.logprobs, trained=True)
        context.append(self.template.close(sample.token_ids))
        body = sample.token_ids[:-1] if sample.finish_reason == "stop" else sample.token_ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        context.messages.append({"role": "assistant", "content": text})
        return Generation(text, list(sample.token_ids), list(sample.logprobs), sample.finish_reason)

    async def observe(self, context: Context, text: str) -> None:
        context.messages.append({"role": "user", "content": text})
        context.append(self.template.observation(text))


def _generation_eos_ids(model: Any) -> list[int]:
    """The model's own end tokens (generation_config may list several, e.g. <|eot_id|>)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
