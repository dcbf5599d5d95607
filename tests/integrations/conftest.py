"""Fixtures of the LlamaIndex and LangChain adapter tests (the shared stores and engines are in tests/conftest.py)."""

import pytest


@pytest.fixture
def decode_batches(adapter_engine, monkeypatch):
    """The batch size of every decode step the engine runs while the test does (a spy on the runner)."""
    runner = adapter_engine.scheduler.runner
    sizes: list[int] = []
    decode = runner.decode

    def spy(seqs, tokens):
        sizes.append(len(seqs))
        return decode(seqs, tokens)

    monkeypatch.setattr(runner, "decode", spy)
    return sizes


@pytest.fixture
def store_engine(tiny_engine, detaches_stores):
    """A fast engine for precache_store's text and resume checks (random weights: its KV serves no real model)."""
    return tiny_engine
