"""Weights to an inference server: saved where it can read them, then its reload route called
(a loopback server stands in for SGLang's /update_weights_from_disk: a test double)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from orchard.train.weight_sync import ServerReload, SharedModel
from tests.json_server import JsonServer
from tests.train.test_rl_trainer import tiny_llama


def test_server_reload_saves_the_weights_and_names_them_to_the_server(tmp_path):
    calls = []

    def answer(path, body):
        calls.append((path, body))
        return 200, {"success": True}

    server = JsonServer(answer)
    try:
        model = tiny_llama()
        asyncio.run(ServerReload(f"{server.url}/update_weights_from_disk", tmp_path).push(model, 3))
    finally:
        server.close()
    assert calls == [("/update_weights_from_disk", {"model_path": str(tmp_path / "step-3")})]
    reloaded = type(model).from_pretrained(tmp_path / "step-3")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


def test_a_refused_reload_is_an_error_naming_the_status(tmp_path):
    server = JsonServer(lambda path, body: (400, {"error": "weights do not match the served model"}))
    try:
        with pytest.raises(RuntimeError, match="400.*do not match"):
            asyncio.run(ServerReload(f"{server.url}/reload", tmp_path).push(tiny_llama(), 1))
    finally:
        server.close()
    asyncio.run(SharedModel().push(tiny_llama(), 1))  # in process: nothing to move
