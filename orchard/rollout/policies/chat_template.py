"""The token pieces a multi-turn rollout needs from a Hugging Face chat template.

A token-level policy never re-renders the conversation (that would re-tokenize what the
model sampled). It needs only three pieces, each computed from a fixed conversation (a
user message, then an assistant message holding a marker): the prompt of the first turn;
the tokens the template puts after an assistant message's content (``<|im_end|>\n``: the
turn's close); and the tokens of a new user message plus the generation prompt (an
observation). The last two are template *deltas*: the fixed conversation is rendered with
and without an extra user message; both renderings must continue the assistant's marker
with the same close, and what follows the close in the longer one is the observation.
Anchoring at the marker rather than comparing whole renderings lets templates rewrite what
comes before it (Qwen3 gives the last assistant message an empty ``<think>`` block and
earlier ones none) without losing exactness; for a prefix-stable template it is the same
as "the shorter rendering is a prefix of the longer, take the suffix".

A template that cannot be split this way (it raises on the fixed conversation, or the
close differs) falls back to plain tokenization: the observation's own text, and the
end-of-sequence token as the turn's close. ``exact`` is then False and a warning is logged
once: the tokens still train correctly (the model is trained on what it saw), but they are
not what the template would have produced.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger(__name__)

USER_MARK = "orchard-user-mark"
ASSISTANT_MARK = "orchard-assistant-mark"
FIXED = [{"role": "user", "content": USER_MARK}, {"role": "assistant", "content": ASSISTANT_MARK}]


class ChatTemplateTokens:
    """Prompt, turn close and observation tokens of one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, extra_stop_ids: Optional[list[int]] = None,
                 template_kwargs: Optional[dict[str, Any]] = None) -> None:
        """``template_kwargs`` go to every rendering (e.g. ``{"enable_thinking": False}``)."""
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.exact = True
        self._close_text: Optional[str] = None
        self.turn_end = self._turn_end()
        stops = {i for i in [tokenizer.eos_token_id, *(extra_stop_ids or [])] if i is not None}
        if self.turn_end and self.turn_end[0] in set(tokenizer.all_special_ids):
            stops.add(self.turn_end[0])  # e.g. <|im_end|> or <end_of_turn> when it is not the eos token
        self.stop_ids = frozenset(stops)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The first turn's context: the messages rendered with the generation prompt."""
        rendered = self._render(messages, generation_prompt=True)
        if rendered is None:
            raise ValueError("the tokenizer's chat template cannot render these messages")
        return self.encode(rendered)

    def close(self, sampled: list[int]) -> list[int]:
        """The template's tokens after a sampled turn: its close, minus the stop token the
        model already sampled (which stays in the context as a trained token)."""
        end = self.turn_end
        if sampled and end and sampled[-1] == end[0]:
            return end[1:]
        return list(end)

    def observation(self, text: str) -> list[int]:
        """A user message carrying ``text``, then the generation prompt (after a closed turn)."""
        longer = self._render([*FIXED, {"role": "user", "content": text}], generation_prompt=True)
        at = longer.find(ASSISTANT_MARK) if longer is not None else -1
        after = longer[at + len(ASSISTANT_MARK):] if longer is not None and at >= 0 else ""
        if self._close_text is not None and at >= 0 and after.startswith(self._close_text):
            return self.encode(after[len(self._close_text):])
        self._fall_back("the template does not close an assistant turn the same way before an extra user message")
        return self.encode(text)

    def _turn_end(self) -> list[int]:
        fixed = self._render(FIXED, generation_prompt=False)
        at = fixed.rfind(ASSISTANT_MARK) if fixed is not None else -1
        if fixed is None or at < 0:
            self._fall_back("the template does not render the fixed conversation")
            eos = self.tokenizer.eos_token_id
            return [eos] if eos is not None else []
        self._close_text = fixed[at + len(ASSISTANT_MARK):]
        return self.encode(self._close_text)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> Optional[str]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                      **self.template_kwargs)
        except Exception as exc:  # templates raise anything (jinja errors, ValueError on role order)
            log.debug("chat template failed on %s: %s", [m["role"] for m in messages], exc)
            return None
        return text if isinstance(text, str) else None

    def _fall_back(self, why: str) -> None:
        if self.exact:
            log.warning("chat template of %s: %s; using plain tokenization for turn glue and observations",
                        getattr(self.tokenizer, "name_or_path", "tokenizer"), why)
        self.exact = False
