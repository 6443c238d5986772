"""Policies whose turns are written in advance, so the rollout loop can be tested without a model.

``ScriptedPolicy`` answers each turn from a list of texts or from a function of the
conversation. With ``tokenized=True`` it also records fake but deterministic tokens, so the
loop's token bookkeeping (masks, lengths, ``max_tokens``) is tested in milliseconds: the
"vocabulary" is the 256 bytes plus :data:`END_OF_TURN`; a message renders as
``<|role|>content`` + END_OF_TURN + ``\\n`` and a prompt ends with ``<|assistant|>``, like a
chat template would. Sampled tokens (the turn's UTF-8 bytes, then END_OF_TURN when the
turn ended by itself) get log-prob ``logprob`` and mask 1; everything else mask 0.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence, Union

from orchard.rollout.actions import SUBMIT_TURN, bash_block
from orchard.rollout.policy import Context, Generation, Policy

END_OF_TURN = 256  # the fake vocabulary's end-of-turn token (one past the bytes)
GENERATION_PROMPT = "<|assistant|>"


SUBMIT = SUBMIT_TURN  # the action that ends an episode

Script = Callable[[list[dict[str, str]], int], str]  # (messages so far, assistant turn index) -> turn text


def encode_text(text: str) -> list[int]:
    return list(text.encode())


def encode_message(role: str, content: str) -> list[int]:
    """A whole message as the fake template renders it, end of turn and newline included."""
    return encode_text(f"<|{role}|>{content}") + [END_OF_TURN] + encode_text("\n")


def decode(tokens: Iterable[int]) -> str:
    """The text of fake tokens (END_OF_TURN reads ``<|end|>``), for assertions and logs."""
    out, pending = [], bytearray()
    for token in tokens:
        if token == END_OF_TURN:
            out.append(pending.decode(errors="replace") + "<|end|>")
            pending = bytearray()
        else:
            pending.append(token)
    return "".join(out) + pending.decode(errors="replace")


class ScriptedPolicy(Policy):
    """Answers from a script; after a list of turns runs out it submits.

    The policy keeps no per-rollout state (the turn index is the number of assistant
    messages so far), so one object serves any number of concurrent rollouts.
    """

    name = "scripted"

    def __init__(self, script: Union[Script, Sequence[str]], *, tokenized: bool = False, logprob: float = -0.1) -> None:
        if isinstance(script, str):
            raise TypeError("script is a list of turns or a function, not one string")
        self.script: Script = script if callable(script) else _from_list(list(script))
        self.tokenized = tokenized
        self.logprob = logprob
        self.calls = 0  # act() calls served, for tests that count turns

    @classmethod
    def commands(cls, commands: Sequence[str], **settings: object) -> "ScriptedPolicy":
        """A policy that runs ``commands`` one per turn (each as a bash block), then submits."""
        return cls([bash_block(command) for command in commands], **settings)  # type: ignore[arg-type]

    async def begin(self, messages: list[dict[str, str]]) -> Context:
        context = Context(messages=[dict(m) for m in messages])
        if self.tokenized:
            prompt = [t for m in messages for t in encode_message(m["role"], m["content"])]
            context.append(prompt + encode_text(GENERATION_PROMPT))
            context.prompt_length = len(context.tokens)
        return context

    async def act(self, context: Context, max_tokens: int) -> Generation:
        turn = sum(1 for m in context.messages if m["role"] == "assistant")
        text = self.write(context, turn)
        if not isinstance(text, str):
            raise TypeError(f"the script returned {type(text).__name__} for turn {turn}, not a string")
        self.calls += 1
        generation = Generation(text=text)
        if self.tokenized:
            generation = self._sample(text, max_tokens)
            context.append(generation.token_ids, generation.logprobs, trained=True)
            ended = generation.finish_reason == "stop"
            context.append(([] if ended else [END_OF_TURN]) + encode_text("\n"))  # the template's glue
        context.messages.append({"role": "assistant", "content": generation.text})
        return generation

    def write(self, context: Context, turn: int) -> str:
        """The text of ``turn``: the script's, from a copy of the conversation."""
        return self.script([dict(m) for m in context.messages], turn)

    async def observe(self, context: Context, text: str) -> None:
        context.messages.append({"role": "user", "content": text})
        if self.tokenized:
            context.append(encode_message("user", text) + encode_text(GENERATION_PROMPT))

    def _sample(self, text: str, max_tokens: int) -> Generation:
        body = encode_text(text)
        if len(body) + 1 <= max_tokens:
            tokens = body + [END_OF_TURN]
            return Generation(text, tokens, [self.logprob] * len(tokens), "stop")
        tokens = body[:max(0, max_tokens)]
        cut = bytes(tokens).decode(errors="ignore")
        return Generation(cut, tokens, [self.logprob] * len(tokens), "length")


def _from_list(turns: list[str]) -> Script:
    def script(messages: list[dict[str, str]], turn: int) -> str:
        return turns[turn] if turn < len(turns) else SUBMIT
    return script
