"""A TEST DOUBLE of vLLM's OpenAI-compatible server: the subset of ``POST /v1/chat/completions``
that OpenAICompatiblePolicy uses, served by FastAPI + uvicorn on loopback in a thread.

Like vLLM it renders the whole conversation each turn with its chat template (by default the
byte-level fake template of the scripted policy: a message is ``<|role|>content`` + end of
turn + newline), answers the next scripted reply, and on request returns log-probs (tokens
as ``"token_id:N"`` with ``return_tokens_as_token_ids``), ``prompt_token_ids`` and
``choices[0].token_ids`` (``return_token_ids``), or, like SGLang, ids on the choice
(``return_prompt_token_ids``). Faults are injected in order before normal answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from orchard.rollout.policies.scripted import END_OF_TURN, GENERATION_PROMPT, encode_message, encode_text


def byte_render(messages: list[dict[str, str]]) -> list[int]:
    return [t for m in messages for t in encode_message(m["role"], m["content"])] + encode_text(GENERATION_PROMPT)


@dataclass
class Fault:
    status: int = 200
    body: Union[dict, str, None] = None  # a str is sent as is (malformed JSON)
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before answering (past the client's timeout: a timeout)
    then_answer: bool = False  # after the delay, answer normally
    late_reply: Optional[str] = None  # what a late answer says (not taken from the scripted replies)


class VLLMDouble:
    def __init__(self, replies: Optional[list[str]] = None, *, render: Callable[[list[dict]], list[int]] = byte_render,
                 encode: Callable[[str], list[int]] = encode_text, end_of_turn: int = END_OF_TURN,
                 logprob: Callable[[int], float] = lambda i: -0.01 * (i + 1)) -> None:
        self.replies = list(replies or [])
        self.render, self.encode, self.end_of_turn, self.logprob = render, encode, end_of_turn, logprob
        self.faults: list[Fault] = []
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.rewrite_history = False  # serve a prompt that drops earlier assistant turns' content
        self.omit_token_ids = False  # no choices[0].token_ids (the "token_id:N" log-prob entries remain)
        self.omit_prompt_ids = False  # no prompt_token_ids (a server older than return_token_ids)
        app = FastAPI()
        app.post("/v1/chat/completions")(self._complete)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the vLLM test double did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.faults:
            fault = self.faults.pop(0)
            await asyncio.sleep(fault.delay)
            if not fault.then_answer:
                if isinstance(fault.body, str):
                    return Response(fault.body, status_code=fault.status, headers=fault.headers,
                                    media_type="application/json")
                return JSONResponse(fault.body, status_code=fault.status, headers=fault.headers)
            return JSONResponse(self.answer(body, fault.late_reply))
        return JSONResponse(self.answer(body))

    def answer(self, body: dict[str, Any], reply: Optional[str] = None) -> dict[str, Any]:
        messages = body["messages"]
        if self.rewrite_history:
            messages = [dict(m, content="") if m["role"] == "assistant" else m for m in messages]
        prompt = self.render(messages)
        if reply is None:
            reply = self.replies.pop(0) if self.replies else "```bash\nsubmit\n```"
        tokens = self.encode(reply) + [self.end_of_turn]
        finish = "stop"
        if len(tokens) > body.get("max_tokens", 1 << 30):
            tokens, finish = tokens[:body["max_tokens"]], "length"
            reply = bytes(t for t in tokens if t < 256).decode(errors="ignore") if self.encode is encode_text else reply
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": reply},
                                  "finish_reason": finish, "stop_reason": None}
        answer: dict[str, Any] = {"id": "chatcmpl-double", "object": "chat.completion", "model": body.get("model"),
                                  "choices": [choice], "usage": {"prompt_tokens": len(prompt),
                                                                 "completion_tokens": len(tokens)}}
        if body.get("logprobs"):
            as_ids = body.get("return_tokens_as_token_ids")
            choice["logprobs"] = {"content": [
                {"token": f"token_id:{t}" if as_ids else f"<{t}>", "logprob": self.logprob(i), "top_logprobs": []}
                for i, t in enumerate(tokens)]}
        if body.get("return_token_ids"):
            if not self.omit_token_ids:
                choice["token_ids"] = tokens
            if self.omit_prompt_ids:
                pass
            elif body.get("return_prompt_token_ids"):  # SGLang puts the prompt's ids on the choice
                choice["prompt_token_ids"] = prompt
            else:
                answer["prompt_token_ids"] = prompt
        return answer
