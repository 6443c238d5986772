"""SWE-ReX (installed from PyPI) drives an Orchard sandbox through its own runtime calls."""

from __future__ import annotations

import pytest
from swerex.exceptions import (CommandTimeoutError, DeploymentNotStartedError, NonZeroExitCodeError,
                               SessionDoesNotExistError, SessionExistsError)
from swerex.runtime.abstract import (AbstractRuntime, BashAction, BashInterruptAction,
                                     CloseBashSessionRequest, Command, CreateBashSessionRequest, ReadFileRequest,
                                     UploadRequest, WriteFileRequest)

from orchard.client.session import SessionDied
from orchard.errors import SandboxNotFound
from orchard.integrations.swe_rex import OrchardDeployment, OrchardDeploymentConfig

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def deployment():
    deployment = OrchardDeploymentConfig(image="host").get_deployment()
    await deployment.start()
    try:
        yield deployment
    finally:
        await deployment.stop()


async def test_sessions_keep_directory_variables_and_functions(deployment):
    runtime = deployment.runtime
    assert isinstance(runtime, AbstractRuntime) and await deployment.is_alive()
    await runtime.create_session(CreateBashSessionRequest())
    await runtime.run_in_session(BashAction(command="mkdir -p /tmp/work && cd /tmp/work && export GREETING=hi"))
    await runtime.run_in_session(BashAction(command="greet() { echo \"$GREETING from $(pwd)\"; }"))
    observation = await runtime.run_in_session(BashAction(command="greet; echo err >&2"))
    assert observation.output == "hi from /tmp/work\nerr\n" and observation.exit_code == 0
    with pytest.raises(SessionExistsError):
        await runtime.create_session(CreateBashSessionRequest())
    # a second session has its own state
    await runtime.create_session(CreateBashSessionRequest(session="other"))
    other = await runtime.run_in_session(BashAction(session="other", command="echo \"[$GREETING]\"; pwd"))
    assert other.output.startswith("[]\n") and "/tmp/work" not in other.output
    await runtime.close_session(CloseBashSessionRequest(session="other"))
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(BashAction(session="other", command="true"))


async def test_exit_codes_checks_and_timeouts(deployment):
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest())
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        await runtime.run_in_session(BashAction(command="echo no; (exit 3)"))
    silent = await runtime.run_in_session(BashAction(command="false", check="silent"))
    assert silent.exit_code == 1
    assert (await runtime.run_in_session(BashAction(command="false", check="ignore"))).exit_code is None
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="sleep 30", timeout=1))
    assert (await runtime.run_in_session(BashInterruptAction())).exit_code == 0
    assert (await runtime.run_in_session(BashAction(command="echo alive"))).output == "alive\n"


async def test_execute_read_write_upload(deployment, tmp_path):
    runtime = deployment.runtime
    response = await runtime.execute(Command(command=["printf", "%s|", "a b", "c"]))
    assert (response.stdout, response.exit_code) == ("a b|c|", 0)
    shell = await runtime.execute(Command(command="echo $X; echo e >&2; exit 4", shell=True, env={"X": "x"}))
    assert (shell.stdout, shell.stderr, shell.exit_code) == ("x\n", "e\n", 4)
    with pytest.raises(NonZeroExitCodeError):
        await runtime.execute(Command(command="false", shell=True, check=True))
    with pytest.raises(CommandTimeoutError):
        await runtime.execute(Command(command="sleep 30", shell=True, timeout=1))

    await runtime.write_file(WriteFileRequest(path="/tmp/deep/dir/notes.txt", content="héllo\n"))
    assert (await runtime.read_file(ReadFileRequest(path="/tmp/deep/dir/notes.txt"))).content == "héllo\n"
    with pytest.raises(FileNotFoundError):
        await runtime.read_file(ReadFileRequest(path="/tmp/no-such-file"))

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "script.sh").chmod(0o755)
    await runtime.upload(UploadRequest(source_path=str(tmp_path / "pkg"), target_path="/tmp/up/pkg"))
    await runtime.upload(UploadRequest(source_path=str(tmp_path / "script.sh"), target_path="/tmp/up/bin/script.sh"))
    check = await runtime.execute(Command(command="cat /tmp/up/pkg/sub/mod.py && /tmp/up/bin/script.sh", shell=True))
    assert check.stdout == "X = 1\nran\n", check.stderr


async def test_stop_deletes_the_sandbox_and_runtime_refuses_after():
    deployment = OrchardDeployment(image="host")
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime
    await deployment.start()
    sandbox = deployment.runtime.sandbox
    await deployment.runtime.close()
    await deployment.stop()
    with pytest.raises(DeploymentNotStartedError):
        deployment.runtime
    from orchard.client import AsyncClient

    async with AsyncClient() as client:
        with pytest.raises(SandboxNotFound):
            await client.get(sandbox.id)
    await deployment.stop()  # twice is fine (SWE-ReX calls it again from __del__)


def test_bad_settings_are_named():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="imgae"):
        OrchardDeploymentConfig(imgae="host")


async def test_sessions_are_real_shells_unexported_state_persists_and_exit_ends_one(deployment):
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest())
    await runtime.run_in_session(BashAction(command="LOCAL=kept; shopt -s expand_aliases; alias hi='echo hi'"))
    assert (await runtime.run_in_session(BashAction(command="echo $LOCAL; hi"))).output.split() == ["kept", "hi"]
    with pytest.raises(SessionDied):
        await runtime.run_in_session(BashAction(command="exit 4"))
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(BashAction(command="true"))
    await runtime.create_session(CreateBashSessionRequest())  # the name is free again
    assert (await runtime.run_in_session(BashAction(command="echo [$LOCAL]"))).output.strip() == "[]"
