"""mini-swe-agent on an Orchard sandbox: an environment class with mini's ``execute`` contract.

Point ``mini`` at it with one config key (no code)::

    environment:
      environment_class: orchard.integrations.mini_swe_agent.OrchardEnvironment
      image: docker://python:3.12        # or "host", a directory image
      backend: local                     # or url: http://orchard:8000 + api_key

Each command runs in the sandbox through the agent, like mini's own ``LocalEnvironment``
runs it on the host: a fresh ``bash -c`` in ``cwd``, stderr merged into stdout, a timeout
that becomes ``returncode -1`` with ``exception_info`` (what mini shows the model), and the
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` first line that ends the run. A lost sandbox is not
an observation: its typed error (``SandboxLost``) propagates and ends the run.
"""

from __future__ import annotations

import platform
import weakref
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from orchard.client import Client

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class OrchardEnvironmentConfig(BaseModel):
    """mini's ``environment`` section (beside ``environment_class``); unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field("host", description="the sandbox's image: 'host', a directory or docker:// reference")
    cwd: str = Field("", description="where commands run when the agent names none ('': the sandbox's "
                                     "default, /workspace or /)")
    env: dict[str, str] = Field(default_factory=dict, description="environment of every command")
    timeout: int = Field(30, description="seconds a command may run (mini's default)")
    url: Optional[str] = Field(None, description="an Orchard server; unset: the backend in process")
    api_key: Optional[str] = Field(None, description="X-API-Key for url (or ORCHARD_API_KEY there)")
    backend: str = Field("local", description="in-process backend name")
    backend_settings: Optional[dict[str, Any]] = Field(None, description="that backend's settings")
    sandbox_id: Optional[str] = Field(None, description="use this existing sandbox (not deleted on cleanup)")
    block_network: bool = Field(True, description="no network in a new sandbox")
    cpu: Optional[str] = None
    memory: Optional[str] = None
    login_shell: bool = Field(False, description="bash --login -i (images that set up conda in ~/.bashrc)")


def _release(client: Client, sandbox: Any, owned: bool) -> None:
    """Delete the sandbox this environment made and close the client: at cleanup, at garbage
    collection or at exit, whichever comes first (mini itself never calls cleanup)."""
    try:
        if owned:
            sandbox.delete()
    finally:
        client.close()


class OrchardEnvironment:
    """An Orchard sandbox behind mini-swe-agent's ``Environment`` protocol."""

    def __init__(self, *, config_class: type = OrchardEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        c = self.config
        self.client = Client(url=c.url, api_key=c.api_key, **({} if c.url else {
            "backend": c.backend, "backend_settings": c.backend_settings}))
        owned = c.sandbox_id is None
        try:
            if owned:
                spec = {k: v for k, v in {"cpu": c.cpu, "memory": c.memory}.items() if v is not None}
                self.sandbox = self.client.create(c.image, block_network=c.block_network, **spec)
            else:
                self.sandbox = self.client.get(c.sandbox_id)
        except BaseException:
            self.client.close()
            raise
        self._finalizer = weakref.finalize(self, _release, self.client, self.sandbox, owned)

    def execute(self, action: dict, cwd: str = "", *, timeout: Optional[int] = None) -> dict[str, Any]:
        """Run ``action["command"]``; ``{"output", "returncode", "exception_info"}`` as mini expects."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        job = self.sandbox.exec("exec 2>&1\n" + command, cwd=cwd or self.config.cwd or None, env=self.config.env,
                                timeout=limit, login_shell=self.config.login_shell)
        output = job.stdout + job.stderr  # stderr holds only what the agent itself adds (a timeout's line)
        if job.error_type == "timeout":
            result = {"output": output, "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: Command '{command}' "
                                        f"timed out after {limit} seconds",
                      "extra": {"exception_type": "TimeoutExpired", "exception": f"timed out after {limit} s"}}
        else:
            result = {"output": output, "returncode": job.exit_code, "exception_info": ""}
        self._check_finished(result)
        return result

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise mini's ``Submitted`` when the first output line is its submit marker."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge

        return recursive_merge(self.config.model_dump(exclude={"api_key"}), platform.uname()._asdict(),
                               {"sandbox_id": self.sandbox.id}, kwargs)

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json", exclude={"api_key"}),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}

    def cleanup(self) -> None:
        """Delete the sandbox (if this environment made it) and close the client; idempotent."""
        self._finalizer()
