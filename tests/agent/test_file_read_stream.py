"""A download's stream frees its helper and its slots however it ends, even never read.

The "helper" is a TEST DOUBLE (a shell that prints the read header and then waits, instead
of ``orchard-enter --file``): what is under test is the agent's side of a download, the
slots and the process. It runs in a child process, because the reaper makes its process a
subreaper.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, gc, sys
    import pytest
    from types import SimpleNamespace
    from orchard.agent.files import SandboxFiles
    from orchard.download_cut import DownloadCut
    from orchard.agent.reaper import ChildReaper
    from orchard.errors import FileOperationFailed

    class WaitingHelper:  # the test double: a read that sends its header and five bytes, then waits
        def file_command(self, sandbox, op):
            if sys.argv[1] == "fails":  # or fails after them, as the real helper reports it
                return ["/bin/sh", "-c", "printf 'ok 5\\\\nhello'; echo 'orchard-file: E5' >&2; exit 3"]
            return ["/bin/sh", "-c", "printf 'ok 5\\\\nhello'; exec sleep 60"]

    class RecordingReaper(ChildReaper):  # keeps the helper's exit, whatever the stream hides
        def wait(self, pid):
            self.last = super().wait(pid)
            return self.last

    async def main(how):
        reaper = RecordingReaper()
        reaper.install(asyncio.get_running_loop())
        sandbox = SimpleNamespace(sandbox_id="sbx-test", file_slots=asyncio.Semaphore(1), check_ready=lambda: None,
                                  placement=SimpleNamespace(default_cwd="/workspace"))
        agent_slots = asyncio.Semaphore(1)
        files = SandboxFiles(WaitingHelper(), sandbox, reaper, agent_slots)
        _, size, stream = await files.open_read("f")
        exited = reaper.last
        if how == "read-one":
            assert await stream.__anext__() == b"hello"
            await stream.aclose()
        elif how == "dropped":  # a response that was never sent: the stream is never started
            del stream
            gc.collect()
        elif how == "cancelled":  # a client gone mid-download: its read waits for more, and is cancelled
            assert await stream.__anext__() == b"hello"
            reading = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            with pytest.raises(StopAsyncIteration):  # and it says so, not a read of a closed socket
                await stream.__anext__()
        elif how == "fails":
            assert await stream.__anext__() == b"hello"
            with pytest.raises(DownloadCut, match="f: Input/output error") as cut:  # the response has started
                await stream.__anext__()
            assert isinstance(cut.value.__cause__, FileOperationFailed)
            await stream.aclose()  # and closing it after changes nothing
        code = await asyncio.wait_for(exited, 5)  # the helper was killed (or ended)
        await asyncio.sleep(0)  # a dropped stream frees them on the loop's next turn
        assert (sandbox.file_slots._value, agent_slots._value) == (1, 1)  # both free again, once each
        print(size, code)

    asyncio.run(main(sys.argv[1]))
""")


def run(how: str) -> str:
    result = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_a_stream_never_read_frees_its_helper_and_slots():
    assert run("dropped") == "5 137"


def test_a_stream_closed_after_one_chunk_frees_them():
    assert run("read-one") == "5 137"


def test_a_stream_whose_read_was_cancelled_frees_them():
    assert run("cancelled") == "5 137"


def test_a_stream_whose_helper_fails_raises_its_error_and_frees_them_once():
    assert run("fails") == "5 3"


def test_uvicorn_logs_no_stack_for_a_cut_download_and_every_other_stack_as_before():
    """A download cut after its response started can only close the connection; the agent
    says so in one line, and the filter drops uvicorn's "Exception in ASGI application"
    stack for it (hundreds a day in an RL run: sandboxes deleted under their diff's download)."""
    import logging

    from orchard.download_cut import DownloadCut, QuietDownloadCuts
    from orchard.errors import FileOperationFailed

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.getLogger("uvicorn.error").makeRecord(
            "uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application\n", (),
            (type(exc), exc, exc.__traceback__))

    def raised(make):
        try:
            make()
        except BaseException as exc:  # noqa: BLE001 - the exception is the test's value
            return exc
        raise AssertionError("nothing raised")

    def starlette_way():  # starlette re-raises what a started response's body raised
        try:
            raise DownloadCut("f: the file call ended with code 137") from FileOperationFailed("f")
        except DownloadCut as cut:
            raise RuntimeError("Caught handled exception, but response already started.") from cut

    def other():
        try:
            raise FileOperationFailed("f: not a regular file")
        except FileOperationFailed as exc:
            raise RuntimeError("something else") from exc

    quiet = QuietDownloadCuts()
    assert not quiet.filter(record(raised(starlette_way)))
    assert quiet.filter(record(raised(other)))
    assert quiet.filter(logging.makeLogRecord({"msg": "no exception"}))
    looped = RuntimeError("a cycle")
    looped.__context__ = RuntimeError("back")
    looped.__context__.__context__ = looped
    assert quiet.filter(record(looped))
