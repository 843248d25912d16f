"""Shared fixtures: tiny real-format models on disk, loaded runners, an HTTP client.

Models load once per session; every test that talks to a runner gets a fresh `Runner`
around the loaded model, so prefix caches never leak between tests.
"""

from __future__ import annotations

import pytest

from runner.engine import Engine
from runner.server.app import build_app
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
def loaded_models(engine, tmp_path_factory):
    """Runners loaded once per architecture; use `fresh_runner` for a clean cache."""
    cache: dict[str, Runner] = {}

    def get(arch: str) -> Runner:
        if arch not in cache:
            path = write_tiny_model(arch, tmp_path_factory.mktemp(arch))
            cache[arch] = Runner.load(engine, str(path))
        return cache[arch]

    return get


@pytest.fixture
def fresh_runner(engine, loaded_models):
    def make(arch: str = "LlamaForCausalLM", **kwargs) -> Runner:
        base = loaded_models(arch)
        return engine.call(
            lambda job: Runner(engine, base.model, base.tokenizer, base.name, **kwargs)
        )

    return make


@pytest.fixture(scope="session")
def llama_loaded(engine, tiny_llama_dir):
    return Runner.load(engine, str(tiny_llama_dir))


@pytest.fixture
def llama_runner(engine, llama_loaded):
    return engine.call(
        lambda job: Runner(engine, llama_loaded.model, llama_loaded.tokenizer, llama_loaded.name)
    )


@pytest.fixture
def make_client(aiohttp_client):
    async def make(runner: Runner, **app_kwargs):
        app = build_app(runner, **app_kwargs)
        return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})

    return make


@pytest.fixture
async def client(make_client, llama_runner):
    return await make_client(llama_runner)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that needs the default model (a download the first time) is marked `slow`,
    so `-m "not slow"` never needs the network; an unmarked one stops the collection."""
    unmarked = [
        item.nodeid
        for item in items
        if "default_model_dir" in getattr(item, "fixturenames", ())
        and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests use the default model (a download on first use) but are not marked "
            "slow: " + ", ".join(unmarked)
        )


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model, prepared once (a 93 MB download and ~10 s the first time) into the
    real cache (or `$OLLAMA_MLX_RUNNER_CACHE`), so later runs and other tests reuse it."""
    import importlib.util

    from runner.sources.default_model import is_prepared, model_dir
    from tools.default_model import prepare_default_model

    if not is_prepared(model_dir()) and importlib.util.find_spec("gguf") is None:
        pytest.skip("preparing the default model needs `pip install .[prepare]` (gguf)")
    return prepare_default_model()


@pytest.fixture
def reference_libraries() -> None:
    """The `reference` tier recomputes goldens with PyTorch + transformers: skip without."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
