"""Chat examples with per-message loss masks -> token ids with per-token loss masks.

The chat template is rendered one message at a time; each message's new text is split
into the template's header, the message content, and its tail. Only the content of a
message with ``loss_mask: 1`` is trained, plus the special token that ends it (so the
model learns to stop); decoding the trained tokens without special tokens gives back
exactly the assistant text that should be learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TokenizedExample:
    input_ids: list[int]
    loss_mask: list[int]


def tokenize_example(tokenizer: Any, messages: list[dict], max_length: int) -> TokenizedExample:
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    special = set(tokenizer.all_special_ids)
    for index, message in enumerate(messages):
        clean = [{"role": m["role"], "content": m["content"]} for m in messages[: index + 1]]
        text = tokenizer.apply_chat_template(clean, tokenize=False)
        if not text.startswith(rendered):
            raise ValueError("the chat template does not render a conversation as a prefix of its extension")
        segment, rendered = text[len(rendered):], text
        trained = bool(message.get("loss_mask", 0)) and message["role"] == "assistant"
        at = segment.find(message["content"]) if message["content"] else -1
        if not trained or at < 0:
            piece = tokenizer.encode(segment, add_special_tokens=False)
            ids += piece
            mask += [0] * len(piece)
            continue
        head = tokenizer.encode(segment[:at], add_special_tokens=False)
        body = tokenizer.encode(message["content"], add_special_tokens=False)
        tail = tokenizer.encode(segment[at + len(message["content"]):], add_special_tokens=False)
        ends = 1 if tail and tail[0] in special else 0
        ids += head + body + tail
        mask += [0] * len(head) + [1] * len(body) + [1] * ends + [0] * (len(tail) - ends)
    return TokenizedExample(ids[:max_length], mask[:max_length])
