"""The action format: what a model writes in a turn and how the loop reads it.

A turn holds exactly one fenced block tagged ``bash``::

    ```bash
    grep -n "def parse" src/*.py
    ```

The block's lines run as one ``bash -c`` command in the task's working directory. A block
whose only content is ``submit`` ends the episode: the agent says it is done, and its
changes are graded. Anything else (no block, two blocks, an empty block) is a format error:
the turn is spent and the observation says how to write the next one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

SUBMIT = "submit"
_BLOCK = re.compile(r"^```bash[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)

FORMAT_HELP = ("Write exactly one ```bash block per turn: the commands to run, or the single word "
               f"`{SUBMIT}` when you are done.")

SYSTEM_PROMPT = f"""You are a software engineer working in a Linux sandbox on a git repository.
Each turn, think briefly, then write exactly one fenced code block tagged bash holding the
commands to run, for example:

```bash
ls -la
```

You will see the commands' exit code and output. Edit files with shell tools (sed, cat with a
here-document, python3, git apply). When the issue is resolved, reply with a block holding only
the word {SUBMIT}:

```bash
{SUBMIT}
```"""


@dataclass(frozen=True)
class Action:
    kind: Literal["bash", "submit", "invalid"]
    command: str = ""
    error: Optional[str] = None  # why an invalid turn was refused (shown to the model)


def parse_action(text: str) -> Action:
    """The one action in a model's turn."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        return Action("invalid", error=f"No ```bash block found. {FORMAT_HELP}")
    if len(blocks) > 1:
        return Action("invalid", error=f"Found {len(blocks)} ```bash blocks; one per turn. {FORMAT_HELP}")
    command = blocks[0].strip()
    if not command:
        return Action("invalid", error=f"The ```bash block is empty. {FORMAT_HELP}")
    if command == SUBMIT:
        return Action("submit")
    return Action("bash", command=command)


def bash_block(command: str) -> str:
    """An assistant turn holding one action in this format (scripted policies, tests)."""
    return f"```bash\n{command}\n```"


SUBMIT_TURN = bash_block(SUBMIT)  # the turn that ends an episode
