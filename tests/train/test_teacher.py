"""The LLM teacher against a real HTTP server on loopback that speaks the OpenAI chat API
(a scripted stand-in for vLLM/SGLang: no model can be downloaded here)."""

from __future__ import annotations

import asyncio
import json

import pytest

from orchard.train.credit import Step, Trajectory
from orchard.train.teacher import LLMTeacher, TeacherError, parse_values, render_prompt
from tests.json_server import JsonServer


class ScriptedChatServer(JsonServer):
    """Answers /v1/chat/completions with the scripted contents in turn (or with
    ``answers(prompt)`` when it is a function); records prompts."""

    def __init__(self, answers) -> None:
        self.answers = answers if callable(answers) else list(answers)
        self.prompts: list[str] = []

        def answer(path: str, body: dict) -> tuple[int, dict]:
            prompt = body["messages"][-1]["content"]
            self.prompts.append(prompt)
            if callable(self.answers):
                content = self.answers(prompt)
            else:
                content = self.answers.pop(0) if self.answers else "{}"
            return 200, {"choices": [{"message": {"role": "assistant", "content": content}}]}

        super().__init__(answer)
        self.url += "/v1"


TRAJ = Trajectory("t9", "make the test pass", [Step("ls", "a.py"), Step("edit a.py", "ok")], resolved=False)


def ask(server, retries=2, cache_path=None, with_outcome=True):
    async def run():
        teacher = LLMTeacher(server.url, "judge", retries=retries, cache_path=cache_path)
        try:
            first = await teacher.values(TRAJ, with_outcome)
            again = await teacher.values(TRAJ, with_outcome)
            return first, again, teacher.calls
        finally:
            await teacher.close()
    return asyncio.run(run())


def test_malformed_answers_are_retried_then_parsed_and_cached(tmp_path):
    server = ScriptedChatServer(["I think it is likely.", '{"values": [0.1, 0.5]}',
                                 'Sure: ```json\n{"values": [0.1, 0.4, 0.2]}\n```'])
    try:
        first, again, calls = ask(server, cache_path=tmp_path / "cache.json")
        assert first == again == [0.1, 0.4, 0.2]
        assert calls == 3  # two malformed answers, one good; the second call came from the cache
        assert "NOT resolve" in server.prompts[0] and "[2] action: edit a.py" in server.prompts[0]
    finally:
        server.close()
    assert json.loads((tmp_path / "cache.json").read_text())


def test_persistent_failure_is_reported_never_zero():
    server = ScriptedChatServer(['{"values": [0.1, 2.0, 0.3]}'] * 3)
    try:
        with pytest.raises(TeacherError, match="between 0 and 1"):
            ask(server, retries=2)
    finally:
        server.close()


def test_forecasts_do_not_see_the_outcome():
    assert "RESOLVED" not in render_prompt(TRAJ, with_outcome=False)
    assert "resolve the task" not in render_prompt(TRAJ, with_outcome=False)
    assert "did NOT resolve" in render_prompt(TRAJ, with_outcome=True)


@pytest.mark.parametrize("answer,problem", [("nothing", "no JSON"), ('{"values": "high"}', "expected"),
                                            ('{"values": [0.1, true, 0.2]}', "between"), ("{bad json}", "invalid JSON")])
def test_strict_parsing(answer, problem):
    with pytest.raises(ValueError, match=problem):
        parse_values(answer, 3)


def test_credit_command_end_to_end(tmp_path):
    import subprocess
    import sys

    from orchard.train.credit import save_jsonl

    trajs = tmp_path / "trajs.jsonl"
    save_jsonl([TRAJ.to_dict(), Trajectory("t10", "x", [Step("a", "b")], resolved=True).to_dict()], trajs)
    answers = {3: '{"values": [0.2, 0.6, 0.3]}', 2: '{"values": [0.5, 0.9]}'}
    server = ScriptedChatServer(lambda prompt: answers[int(prompt.split("with exactly ")[1].split()[0])])
    try:
        out_file = tmp_path / "sft.jsonl"
        result = subprocess.run([sys.executable, "-m", "orchard.cli", "credit", str(trajs), "--out", str(out_file),
                                 "--teacher-url", server.url, "--model", "judge", "--calibrate"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["trained_actions"] == 2 and "brier_before" in report["calibration"]
        examples = [json.loads(line) for line in out_file.read_text().splitlines()]
        failed = examples[0]
        assert [m["content"] for m in failed["messages"] if m["loss_mask"]] == ["ls"]  # 0.2 -> 0.6 ascends
    finally:
        server.close()


def test_ensemble_teachers_sharing_a_cache_file_keep_each_others_answers(tmp_path):
    from orchard.train.credit import EnsembleEstimator

    cache = tmp_path / "cache.json"
    server = ScriptedChatServer(lambda prompt: '{"values": [0.1, 0.4, 0.2]}')

    async def grade(models):
        teachers = [LLMTeacher(server.url, m, cache_path=cache) for m in models]
        try:
            await EnsembleEstimator(teachers).values(TRAJ)
        finally:
            for teacher in teachers:
                await teacher.close()
        return [t.calls for t in teachers]

    try:
        assert asyncio.run(grade(["judge-a", "judge-b"])) == [1, 1]
        assert len(json.loads(cache.read_text())) == 2
        assert asyncio.run(grade(["judge-a", "judge-b"])) == [0, 0]  # both answered from the cache
        assert len(server.prompts) == 2
    finally:
        server.close()


class StatusServer(JsonServer):
    """Answers with the scripted (status, body) pairs in turn, then a good completion."""

    def __init__(self, script) -> None:
        self.script = list(script)
        self.requests = 0

        def answer(path: str, body: dict) -> tuple[int, dict]:
            self.requests += 1
            if self.script:
                return self.script.pop(0)
            return 200, {"choices": [{"message": {"role": "assistant", "content": '{"values": [0.1, 0.4, 0.2]}'}}]}

        super().__init__(answer)
        self.url += "/v1"


def grade_once(url, **options):
    async def run():
        teacher = LLMTeacher(url, "judge", backoff=0.01, **options)
        try:
            return await teacher.values(TRAJ), teacher.calls
        finally:
            await teacher.close()
    return asyncio.run(run())


def test_transient_http_errors_are_retried_with_backoff():
    server = StatusServer([(503, {"error": {"message": "overloaded"}}), (429, {"error": {"message": "slow down"}})])
    try:
        values, calls = grade_once(server.url)
        assert values == [0.1, 0.4, 0.2] and calls == 3 and server.requests == 3
    finally:
        server.close()


def test_a_client_error_is_not_retried_and_names_status_and_message():
    from orchard.train.teacher import TeacherHTTPError

    server = StatusServer([(400, {"error": {"message": "model 'judge' does not exist"}})])
    try:
        with pytest.raises(TeacherHTTPError, match=r"400.*model 'judge' does not exist") as caught:
            grade_once(server.url)
        assert caught.value.status == 400 and server.requests == 1
    finally:
        server.close()


def test_transient_errors_give_up_after_the_attempts():
    from orchard.train.teacher import TeacherHTTPError

    server = StatusServer([(503, {"detail": "warming up"})] * 10)
    try:
        with pytest.raises(TeacherHTTPError, match=r"3 attempts.*503.*warming up") as caught:
            grade_once(server.url, http_attempts=3)
        assert caught.value.status == 503 and server.requests == 3
    finally:
        server.close()
    import socket

    with socket.socket() as sock:  # a port nobody listens on: connection refused, retried, then reported
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TeacherHTTPError, match="2 attempts.*Connect") as caught:
        grade_once(f"http://127.0.0.1:{port}/v1", http_attempts=2)
    assert caught.value.status is None


def test_resolved_trajectories_cost_no_teacher_call():
    from orchard.train.credit_pipeline import build_sft_dataset

    solved = Trajectory("t10", "x", [Step("a", "b")], resolved=True)
    server = ScriptedChatServer(lambda prompt: '{"values": [0.2, 0.6, 0.3]}')

    async def run():
        teacher = LLMTeacher(server.url, "judge")
        try:
            return await build_sft_dataset([TRAJ, solved], teacher), teacher.calls
        finally:
            await teacher.close()

    try:
        result, calls = asyncio.run(run())
        assert calls == 1 and len(server.prompts) == 1 and "did NOT resolve" in server.prompts[0]
        assert [e["task_id"] for e in result.examples] == ["t9", "t10"]
    finally:
        server.close()


def test_credit_command_reports_a_refusing_endpoint_in_one_line(tmp_path):
    import subprocess
    import sys

    from orchard.train.credit import save_jsonl

    trajs = tmp_path / "trajs.jsonl"
    save_jsonl([TRAJ.to_dict()], trajs)
    server = StatusServer([(401, {"error": {"message": "invalid api key"}})])
    try:
        result = subprocess.run([sys.executable, "-m", "orchard.cli", "credit", str(trajs), "--out",
                                 str(tmp_path / "sft.jsonl"), "--teacher-url", server.url, "--model", "judge"],
                                capture_output=True, text=True, timeout=60)
    finally:
        server.close()
    assert result.returncode == 2, result.stderr
    assert "TeacherHTTPError" in result.stderr and "401" in result.stderr and "invalid api key" in result.stderr
    assert "Traceback" not in result.stderr
