"""TEST DOUBLES for the slime contract tests: none of this is slime or SGLang.

- :class:`StandInSample` is a STAND-IN for ``slime.utils.types.Sample`` as of THUDM/slime
  commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (``slime/utils/types.py``): the same field
  names, defaults and ``Status`` values, and the length checks of
  ``Sample._validate_response_metadata_lengths``; :func:`slime_train_data` re-states the
  checks of ``RolloutManager._convert_samples_to_train_data`` (``slime/ray/rollout.py``), and
  :func:`slime_default_rewards` its default ``_post_process_rewards`` (GRPO group norm over
  fixed rows of ``n_samples_per_prompt``). Written from reading that code, not copied.
- :class:`DataSource` hands out groups as ``RolloutDataSource.get_samples`` does.
- :class:`SGLangDouble` is a loopback HTTP server speaking the subset of SGLang's native
  ``POST /generate`` and ``POST /abort_request`` that slime and Orchard use; the sampled
  tokens come from a script (so rollouts do known things in sandboxes) and their
  log-probs from a tiny Llama built here from a config (nothing is downloaded).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from tests.json_server import JsonServer
from tests.rollout.tiny_lm import make_tokenizer

HOLD, ABORT = "<hold until aborted>", "<abort at once>"


@dataclass
class StandInSample:
    """STAND-IN for slime's ``Sample`` (see the module docstring for the commit it mirrors)."""

    group_index: Optional[int] = None
    index: Optional[int] = None
    rollout_id: Optional[int] = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: Optional[dict] = None
    multimodal_train_inputs: Optional[dict] = None
    response: str = ""
    response_length: int = 0
    label: Optional[str] = None
    reward: Any = None
    loss_mask: Optional[list[int]] = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: Optional[list[float]] = None
    remove_sample: bool = False
    teacher_log_probs: Optional[list[float]] = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: Optional[str] = None
    custom_rm_path: Optional[str] = None
    train_metadata: Optional[dict] = None
    session_id: Optional[str] = None

    def validate(self) -> None:
        """slime's ``_validate_response_metadata_lengths``."""
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError("rollout_log_probs length != response_length")


def slime_train_data(samples: list[StandInSample], rewards: list[float]) -> dict[str, list]:
    """What slime's ``_convert_samples_to_train_data`` asserts and builds (the parts we feed)."""
    assert len(rewards) == len(samples)
    for sample in samples:
        sample.validate()
        assert isinstance(sample.status, StandInSample.Status)
        assert sample.loss_mask is not None and len(sample.loss_mask) == sample.response_length
        assert 0 < sample.response_length <= len(sample.tokens)
        if sample.remove_sample:
            sample.loss_mask = [0] * sample.response_length
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "rewards": rewards, "loss_masks": [s.loss_mask for s in samples],
            "rollout_log_probs": [s.rollout_log_probs for s in samples],
            "truncated": [int(s.status == StandInSample.Status.TRUNCATED) for s in samples]}


def slime_default_rewards(samples: list[StandInSample], group_size: int) -> list[float]:
    """slime's default GRPO normalization: fixed rows of G, (r - mean) / (std + 1e-6)."""
    rewards = torch.tensor([float(s.reward) for s in samples]).reshape(-1, group_size)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    return (centred / (centred.std(dim=-1, keepdim=True) + 1e-6)).flatten().tolist()


class DataSource:
    """``get_samples(n)``: n prompts, each as a group of ``n_samples_per_prompt`` copies."""

    def __init__(self, rows: list[dict], n_samples_per_prompt: int) -> None:
        self.rows, self.n = rows, n_samples_per_prompt
        self.offset = self.group_index = self.index = 0

    def get_samples(self, num: int) -> list[list[StandInSample]]:
        groups = []
        for _ in range(num):
            row = self.rows[self.offset % len(self.rows)]
            self.offset += 1
            prompt = StandInSample(prompt=row["prompt"], metadata=copy.deepcopy(row.get("metadata") or {}))
            group = []
            for _ in range(self.n):
                sample = copy.deepcopy(prompt)
                sample.group_index, sample.index = self.group_index, self.index
                self.index += 1
                group.append(sample)
            self.group_index += 1
            groups.append(group)
        return groups


def slime_args(**overrides: Any) -> SimpleNamespace:
    values = dict(rollout_batch_size=2, n_samples_per_prompt=4, advantage_estimator="grpo",
                  rewards_normalization=True, grpo_std_normalization=True, partial_rollout=False,
                  custom_reward_post_process_path="orchard.integrations.slime.reward_post_process",
                  rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=64,
                  rollout_max_context_len=None, hf_checkpoint="(built in the test)", reward_key=None,
                  seq_length=4096)
    values.update(overrides)
    return SimpleNamespace(**values)


def tiny_llama(tokenizer: Any, seed: int = 0) -> Any:
    """A 2-layer Llama with room for whole agent conversations."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16384,
                                      vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return transformers.LlamaForCausalLM(config).to(torch.float32).eval()


def model_logprobs(model: Any, tokens: list[int], start: int) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i >= start, one forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, start - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[start:])[:, None]).squeeze(1).tolist()


class SGLangDouble:
    """A TEST DOUBLE of SGLang's ``/generate`` on loopback (see the module docstring).

    ``respond(prompt_text, body)`` gives the reply text, or :data:`ABORT` (answered at once
    with ``finish_reason: abort``) or :data:`HOLD` (answered with ``abort`` once
    ``/abort_request`` names it or all). Each request is served in its own thread."""

    def __init__(self, respond: Callable[[str, dict], str], tokenizer: Any = None, model: Any = None) -> None:
        self.respond = respond
        self.tokenizer = tokenizer or make_tokenizer()
        self.model = model or tiny_llama(self.tokenizer)
        self.requests: list[dict] = []
        self.aborts: list[dict] = []
        self.held: dict[str, threading.Event] = {}
        self.http = JsonServer(self._answer)
        self.url = self.http.url

    def close(self) -> None:
        for event in self.held.values():
            event.set()
        self.http.close()

    def _answer(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/abort_request":
            self.aborts.append(body)
            for rid, event in list(self.held.items()):
                if body.get("abort_all") or body.get("rid") == rid:
                    event.set()
            return 200, {}
        if path != "/generate":
            return 404, {"detail": f"no route {path}"}
        self.requests.append(body)
        return 200, self._generate(body)

    def _generate(self, body: dict) -> dict:
        prompt, params, rid = body["input_ids"], body["sampling_params"], body.get("rid", "")
        reply = self.respond(self.tokenizer.decode(prompt), body)
        if reply in (HOLD, ABORT):
            if reply == HOLD:
                self.held[rid] = threading.Event()
                self.held[rid].wait(60)
            return {"text": "", "output_ids": [], "meta_info": {
                "id": rid, "finish_reason": {"type": "abort", "message": "aborted"}, "prompt_tokens": len(prompt),
                "completion_tokens": 0, "output_token_logprobs": []}}
        ids = list(self.tokenizer.encode(reply, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        finish: dict[str, Any] = {"type": "stop", "matched": self.tokenizer.eos_token_id}
        if len(ids) > params["max_new_tokens"]:
            ids, finish = ids[:params["max_new_tokens"]], {"type": "length", "length": params["max_new_tokens"]}
        logprobs = model_logprobs(self.model, prompt + ids, len(prompt))
        return {"text": self.tokenizer.decode(ids), "output_ids": ids, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(ids),
            "cached_tokens": 0, "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}
