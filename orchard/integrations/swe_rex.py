"""SWE-ReX on Orchard: a deployment (where the sandbox lives) and a runtime (what runs commands)
speaking SWE-ReX's abstract interfaces, so SWE-agent runs its sessions in Orchard sandboxes.

    deployment = OrchardDeployment(image="docker://python:3.12", backend="local")
    await deployment.start()
    runtime = deployment.runtime          # swerex.runtime.abstract.AbstractRuntime
    await runtime.create_session(CreateBashSessionRequest())
    await runtime.run_in_session(BashAction(command="cd /repo && export X=1"))

Each SWE-ReX session is a real long-lived bash on a terminal in the sandbox
(:meth:`AsyncSandbox.session`): directory, variables (exported or not), functions, aliases
and shell options persist, and ``exit`` ends the session as it would in SWE-ReX's own.
Errors come back as SWE-ReX's own types (``NonZeroExitCodeError``, ``CommandTimeoutError``,
``SessionExistsError``, ``SessionDoesNotExistError``, ``DeploymentNotStartedError``), so
harness code that catches them keeps working; Orchard's typed errors (``SandboxLost``)
propagate as they are.
"""

from __future__ import annotations

import io
import logging
import posixpath
import shlex
import tarfile
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (CommandTimeoutError, DeploymentNotStartedError, NonZeroExitCodeError,
                               SessionDoesNotExistError, SessionExistsError)
from swerex.runtime.abstract import (AbstractRuntime, BashInterruptAction, BashObservation,
                                     CloseBashSessionResponse, CloseResponse, Command, CommandResponse,
                                     CreateBashSessionResponse, IsAliveResponse, ReadFileResponse, UploadResponse,
                                     WriteFileResponse)

from orchard.client.aio import AsyncClient, AsyncSandbox
from orchard.errors import FileOperationFailed, Unsupported
from orchard.client.session import AsyncShellSession, SessionDied

logger = logging.getLogger("orchard.swe_rex")


class OrchardRuntime(AbstractRuntime):
    """SWE-ReX's runtime over one Orchard sandbox (the deployment owns the sandbox's life)."""

    def __init__(self, sandbox: AsyncSandbox, *, logger: Optional[logging.Logger] = None) -> None:
        self.sandbox = sandbox
        self.logger = logger or globals()["logger"]
        self.sessions: dict[str, AsyncShellSession] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        info = await self.sandbox.refresh()
        return IsAliveResponse(is_alive=info.ready, message="" if info.ready else f"sandbox is {info.status}")

    async def create_session(self, request: Any) -> CreateBashSessionResponse:
        if request.session in self.sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        session = await self.sandbox.session(timeout=max(request.startup_timeout, 1.0) + 30)
        output = []
        for path in request.startup_source:
            result = await session.run(f". {shlex.quote(path)}", timeout=max(request.startup_timeout, 1.0))
            output.append(result.output)
            if result.timed_out or result.exit_code != 0:
                await session.close()
                raise NonZeroExitCodeError(f"session {request.session!r} did not start: sourcing {path} "
                                           f"{'timed out' if result.timed_out else f'exited {result.exit_code}'}: "
                                           f"{result.output}")
        self.sessions[request.session] = session
        return CreateBashSessionResponse(output="".join(output))

    def _session(self, name: str) -> AsyncShellSession:
        if name not in self.sessions:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return self.sessions[name]

    async def run_in_session(self, action: Any) -> BashObservation:
        session = self._session(action.session)
        if isinstance(action, BashInterruptAction):  # a command runs only inside run_in_session: nothing to stop
            return BashObservation(output="", exit_code=0)
        if action.is_interactive_command or action.is_interactive_quit or action.expect:
            raise Unsupported("interactive session commands (is_interactive_command, expect) are not mapped yet; "
                              "use the sandbox's terminal (AsyncSandbox.pty) for them")
        try:
            result = await session.run(action.command, timeout=action.timeout)
        except SessionDied:
            del self.sessions[action.session]  # its shell is gone; a new one can take the name
            raise
        if result.timed_out:
            raise CommandTimeoutError(f"timeout ({action.timeout}s) exceeded while running command "
                                      f"{action.command!r}; output so far:\n{result.output}")
        exit_code = None if action.check == "ignore" else result.exit_code
        if action.check == "raise" and result.exit_code != 0:
            message = (f"Command {action.command!r} failed with exit code {result.exit_code}. "
                       f"Here is the output:\n{result.output!r}")
            raise NonZeroExitCodeError(f"{action.error_msg}: {message}" if action.error_msg else message)
        return BashObservation(output=result.output, exit_code=exit_code)

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        session = self._session(request.session)
        del self.sessions[request.session]
        await session.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """A command outside any session, like ``subprocess.run`` (a string needs ``shell=True``)."""
        argv = command.command if isinstance(command.command, str) and command.shell else (
            [command.command] if isinstance(command.command, str) else list(command.command))
        text = argv if isinstance(argv, str) else shlex.join(argv)
        if command.merge_output_streams:
            text = "exec 2>&1\n" + text
        job = await self.sandbox.exec(text, timeout=command.timeout, cwd=command.cwd, env=command.env)
        if job.error_type == "timeout":
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        response = CommandResponse(stdout=job.stdout, stderr=job.stderr, exit_code=job.exit_code)
        if command.check and job.exit_code != 0:
            message = (f"Command {command.command!r} failed with exit code {job.exit_code}. "
                       f"Stdout:\n{job.stdout!r}\nStderr:\n{job.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {message}" if command.error_msg else message)
        return response

    async def read_file(self, request: Any) -> ReadFileResponse:
        try:
            data = await self.sandbox.download(request.path)
        except FileOperationFailed as exc:
            if "no such file" in str(exc).lower() or "not found" in str(exc).lower():
                raise FileNotFoundError(str(exc)) from exc
            raise
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: Any) -> WriteFileResponse:
        await self._mkdir(posixpath.dirname(request.path))
        await self.sandbox.upload(request.path, request.content)
        return WriteFileResponse()

    async def upload(self, request: Any) -> UploadResponse:
        """A local file or directory into the sandbox (a directory goes as one tar, unpacked there)."""
        source, target = Path(request.source_path), request.target_path
        if source.is_dir():
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as tar:
                tar.add(source, arcname=".")
            staging = f"/tmp/.orchard-upload-{source.name or 'dir'}.tar"
            await self.sandbox.upload(staging, buffer.getvalue())
            quoted = shlex.quote(target)
            await self.sandbox.exec(f"mkdir -p {quoted} && tar -xf {shlex.quote(staging)} -C {quoted} --no-same-owner"
                                    f" && rm -f {shlex.quote(staging)}", check=True, timeout=300)
        else:
            await self._mkdir(posixpath.dirname(target))
            await self.sandbox.upload(target, source.read_bytes(), mode=source.stat().st_mode & 0o777)
        return UploadResponse()

    async def _mkdir(self, path: str) -> None:
        if path and path not in ("/", "."):
            await self.sandbox.exec(["mkdir", "-p", "--", path], check=True, timeout=60)

    async def close(self) -> CloseResponse:
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            await session.close()
        return CloseResponse()


class OrchardDeploymentConfig(BaseModel):
    """Settings of :class:`OrchardDeployment` (``get_deployment()`` builds one), like SWE-ReX's
    own deployment configs; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["orchard"] = "orchard"
    image: str = Field("host", description="'host', a directory image or a docker:// reference")
    url: Optional[str] = Field(None, description="an Orchard server; unset: the backend in process")
    api_key: Optional[str] = None
    backend: str = "local"
    backend_settings: Optional[dict[str, Any]] = None
    block_network: bool = True
    cpu: Optional[str] = None
    memory: Optional[str] = None
    startup_timeout: float = Field(300.0, description="seconds to wait for the sandbox to be ready")

    def get_deployment(self) -> "OrchardDeployment":
        return OrchardDeployment.from_config(self)


class OrchardDeployment(AbstractDeployment):
    """A sandbox made at ``start()`` and deleted at ``stop()``; ``runtime`` talks to it."""

    def __init__(self, *, logger: Optional[logging.Logger] = None, **kwargs: Any) -> None:
        self._config = OrchardDeploymentConfig(**kwargs)
        self.logger = logger or globals()["logger"]
        self._hooks = CombinedDeploymentHook()
        self._client: Optional[AsyncClient] = None
        self._runtime: Optional[OrchardRuntime] = None

    @classmethod
    def from_config(cls, config: OrchardDeploymentConfig) -> "OrchardDeployment":
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> OrchardRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._runtime is not None:
            return
        c = self._config
        self._hooks.on_custom_step("Starting Orchard sandbox")
        client = AsyncClient(url=c.url, api_key=c.api_key, **({} if c.url else {
            "backend": c.backend, "backend_settings": c.backend_settings}))
        spec = {k: v for k, v in {"cpu": c.cpu, "memory": c.memory}.items() if v is not None}
        try:
            sandbox = await client.create(c.image, block_network=c.block_network, timeout=c.startup_timeout, **spec)
        except BaseException:
            await client.close()
            raise
        self._client, self._runtime = client, OrchardRuntime(sandbox, logger=self.logger)
        self.logger.info("Orchard sandbox %s ready", sandbox.id)

    async def stop(self) -> None:
        """Delete the sandbox and close the client; safe to call twice (SWE-ReX calls it from __del__)."""
        runtime, client = self._runtime, self._client
        self._runtime = self._client = None
        try:
            if runtime is not None:
                await runtime.sandbox.delete()
        finally:
            if client is not None:
                await client.close()
