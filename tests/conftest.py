"""Shared fixtures: tiny real-format models on disk, a loaded runner, an HTTP client."""

from __future__ import annotations

import pytest

from runner.app import build_app
from runner.engine import Engine
from runner.service import Runner
from tests.tiny import write_tiny_model


@pytest.fixture(scope="session")
def engine():
    e = Engine()
    yield e
    e.stop(timeout=10)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return write_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def llama_runner(engine, tiny_llama_dir):
    return Runner.load(engine, str(tiny_llama_dir))


@pytest.fixture
async def client(aiohttp_client, llama_runner):
    return await aiohttp_client(
        build_app(llama_runner), server_kwargs={"handler_cancellation": True}
    )
