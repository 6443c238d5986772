"""Orchard's rollouts, rewards and SFT data for THUDM's slime (Megatron + SGLang on Ray).

Functions for slime's flags (see docs/training-at-scale.md):

- ``--rollout-function-path orchard.integrations.slime.generate_rollout``: BAR groups of
  multi-turn rollouts in Orchard sandboxes, generated through SGLang's ``/generate``;
- ``--custom-reward-post-process-path orchard.integrations.slime.reward_post_process``:
  the standalone trainer's group-relative advantages for uneven BAR groups;
- ``--custom-rm-path orchard.integrations.slime.grade_reward``: grading in a fresh fork;
- ``--custom-generate-function-path orchard.integrations.slime.generate``: one rollout per
  sample for slime's own rollout loop;
- ``--rollout-function-path orchard.integrations.slime.generate_sft_rollout``: credit-assigned
  SFT data with per-token loss masks.

Importing this package does not import slime; building a ``Sample`` does (or the class
given to :func:`set_sample_class`), with an error naming what to install when it is absent.
"""

from orchard.integrations.slime.grading import generate, grade_reward
from orchard.integrations.slime.rewards import reward_post_process
from orchard.integrations.slime.rollout import (
    check_args, fill_group, generate_rollout, prompt_rows, task_of, write_prompt_data,
)
from orchard.integrations.slime.runtime import SlimeRuntime, configure, runtime, shutdown
from orchard.integrations.slime.samples import SlimeNotInstalled, check_sample, fill_sample, sample_class, set_sample_class
from orchard.integrations.slime.settings import SlimeSettings
from orchard.integrations.slime.sft import generate_sft_rollout, sft_sample
from orchard.integrations.slime.sglang import GenerationAborted, SGLangPolicy, parse_generate

__all__ = [
    "GenerationAborted", "SGLangPolicy", "SlimeNotInstalled", "SlimeRuntime", "SlimeSettings", "check_args",
    "check_sample", "configure", "fill_group", "fill_sample", "generate", "generate_rollout", "generate_sft_rollout",
    "grade_reward", "parse_generate", "prompt_rows", "reward_post_process", "runtime", "sample_class",
    "set_sample_class", "sft_sample", "shutdown", "task_of", "write_prompt_data",
]
