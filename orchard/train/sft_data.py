"""Chat examples with per-message loss masks -> token ids with per-token loss masks.

The chat template is rendered one message at a time; each message's new text is split
into the template's header, the message content, and its tail. Only the content of a
message with ``loss_mask: 1`` is trained, plus the special token that ends it (so the
model learns to stop); decoding the trained tokens without special tokens gives back
exactly the assistant text that should be learned.

Too long a conversation loses its oldest middle turns, never its end: the last actions
are the ones that decided the outcome (and, for a failed trajectory, often the only ones
trained). The head (everything before the first assistant turn: system prompt and task)
is kept, then whole turns (an assistant message and what follows it up to the next one)
are dropped oldest first until the rest fits. If the head and the last turn alone do not
fit, the head is kept and the last turn is cut from its start; if the head alone does not
fit, the last ``max_length`` tokens are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Piece = tuple[list[int], list[int]]  # token ids and their loss mask, for one message


@dataclass
class TokenizedExample:
    input_ids: list[int]
    loss_mask: list[int]
    dropped_messages: int = 0  # whole messages removed to fit max_length


def _pieces(tokenizer: Any, messages: list[dict]) -> list[Piece]:
    pieces: list[Piece] = []
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
            pieces.append((piece, [0] * len(piece)))
            continue
        head = tokenizer.encode(segment[:at], add_special_tokens=False)
        body = tokenizer.encode(message["content"], add_special_tokens=False)
        tail = tokenizer.encode(segment[at + len(message["content"]):], add_special_tokens=False)
        ends = 1 if tail and tail[0] in special else 0
        pieces.append((head + body + tail, [0] * len(head) + [1] * len(body) + [1] * ends + [0] * (len(tail) - ends)))
    return pieces


def _join(pieces: list[Piece]) -> Piece:
    return [t for ids, _ in pieces for t in ids], [m for _, mask in pieces for m in mask]


def tokenize_example(tokenizer: Any, messages: list[dict], max_length: int) -> TokenizedExample:
    if max_length < 1:
        raise ValueError("max_length must be at least 1")
    pieces = _pieces(tokenizer, messages)
    first_action = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    head, rest = pieces[:first_action], pieces[first_action:]
    head_length = sum(len(ids) for ids, _ in head)
    starts = [i for i in range(len(rest)) if messages[first_action + i]["role"] == "assistant"] or [0]
    length = head_length + sum(len(ids) for ids, _ in rest)
    cut = 0  # messages of rest dropped: always a turn boundary, never the last turn
    for start in starts[1:]:
        if length <= max_length:
            break
        length -= sum(len(ids) for ids, _ in rest[cut:start])
        cut = start
    ids, mask = _join(head + rest[cut:])
    if len(ids) > max_length:
        keep_head = head_length if head_length < max_length else 0
        ids = ids[:keep_head] + ids[len(ids) - (max_length - keep_head):]
        mask = mask[:keep_head] + mask[len(mask) - (max_length - keep_head):]
    return TokenizedExample(ids, mask, cut)
