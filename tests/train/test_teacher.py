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
