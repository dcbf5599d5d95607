"""The converted-model cache (model/checkpoint_cache.py) and the warm-up at load.

A GGUF is converted once (here the conversion is the session's GGUF load, ``default_hf``, handed to the cache instead
of a second 30 s parse) and read from the cache afterwards; a damaged folder is discarded and converted again; the
engine is the same, fingerprint included, either way."""

import json
import logging
import os

import pytest
import torch

from lazyrag.engine import LazyEngine
from lazyrag.kv.cache import CacheConfig
from lazyrag.model import checkpoint_cache, loader
from lazyrag.model.checkpoint_cache import MANIFEST, WEIGHTS, cache_folder

KW = dict(device="cpu", kv_budget=64 << 20, warmup=False)


@pytest.fixture
def conversions(tmp_path, monkeypatch, default_hf):
    """A fresh cache folder for the test, and a list of the GGUF conversions made (each is the session's GGUF load)."""
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LAZYRAG_MODEL_CACHE", raising=False)
    made = []

    def convert(source, dtype):
        made.append(source.name)
        assert dtype == torch.float32
        return default_hf

    monkeypatch.setattr(checkpoint_cache, "load_checkpoint", convert)
    return made


def _folder():
    return cache_folder(loader.default_model_source(), torch.float32)


def _no_gguf_reads(monkeypatch):
    """Make any read of the GGUF by transformers (or a conversion) fail the test."""
    import gguf

    def refuse(*a, **k):
        raise AssertionError("the GGUF was parsed although the cache holds its conversion")

    monkeypatch.setattr(checkpoint_cache, "load_checkpoint", refuse)
    monkeypatch.setattr("lazyrag.engine.engine.load_checkpoint", refuse)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def test_first_load_converts_the_second_reads_the_cache(conversions, monkeypatch, default_engine):
    assert not _folder().exists()
    first = LazyEngine.from_pretrained(**KW)
    assert conversions == [loader.DEFAULT_MODEL_FILE]
    manifest = json.loads((_folder() / MANIFEST).read_text())
    assert manifest["gguf_file"] == loader.DEFAULT_MODEL_FILE and manifest["fingerprint"] == first.fingerprint
    assert (
        (_folder() / WEIGHTS).is_file()
        and (_folder() / "config.json").is_file()
        and (_folder() / "tokenizer.json").is_file()
    )
    assert not [p for p in _folder().parent.iterdir() if p.name.startswith(".tmp-")], "a temporary folder was left"

    _no_gguf_reads(monkeypatch)
    second = LazyEngine.from_pretrained(**KW)
    assert second.model_name == first.model_name == loader.DEFAULT_MODEL_FILE
    # the same model as the GGUF loaded by transformers: fingerprint, prompts' tokens, end tokens and logits
    assert second.fingerprint == first.fingerprint == default_engine.fingerprint
    layout = second.build_prompt("Who discovered penicillin?", ["Alexander Fleming discovered penicillin in 1928."])
    reference = default_engine.build_prompt(
        "Who discovered penicillin?", ["Alexander Fleming discovered penicillin in 1928."]
    )
    assert layout.full_ids() == reference.full_ids()
    assert second.scheduler.end_tokens == default_engine.scheduler.end_tokens
    assert torch.equal(second.layout_logits(layout, "full"), default_engine.layout_logits(reference, "full"))


@pytest.mark.parametrize(
    "damage",
    [
        "truncated weights",
        "overwritten weights",
        "no manifest",
        "another GGUF's manifest",
        "unreadable config",
        "edited tokenizer",
    ],
)
def test_a_damaged_cache_is_discarded_and_converted_again(conversions, damage, caplog, default_engine):
    LazyEngine.from_pretrained(**KW)
    folder = _folder()
    weights = folder / WEIGHTS
    if damage == "truncated weights":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "overwritten weights":  # same size, other bytes: only the fingerprint can tell
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size // 2)
            f.write(os.urandom(1 << 20))
    elif damage == "no manifest":  # what a writer killed before its last file would leave, had it not renamed last
        (folder / MANIFEST).unlink()
    elif damage == "another GGUF's manifest":
        manifest = json.loads((folder / MANIFEST).read_text())
        (folder / MANIFEST).write_text(json.dumps({**manifest, "gguf_sha256": "0" * 64}))
    elif damage == "edited tokenizer":  # still valid JSON of the same size: only its digest can tell
        data = bytearray((folder / "tokenizer.json").read_bytes())
        i = data.index(b"a", len(data) // 2)
        data[i] = ord("b")
        (folder / "tokenizer.json").write_bytes(data)
    else:
        (folder / "config.json").write_text("{not json")
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["files"]["config.json"] = (folder / "config.json").stat().st_size
        del manifest["sha256"]["config.json"]  # so that reading it is what fails
        (folder / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="lazyrag.model.checkpoint_cache"):
        again = LazyEngine.from_pretrained(**KW)
    assert conversions == [loader.DEFAULT_MODEL_FILE] * 2
    assert "discarding the model cache" in caplog.text
    assert again.fingerprint == default_engine.fingerprint
    assert json.loads((folder / MANIFEST).read_text())["fingerprint"] == again.fingerprint  # rebuilt whole


def test_a_killed_writers_temporary_folder_is_never_read_and_is_removed(conversions):
    parent = _folder().parent
    parent.mkdir(parents=True, exist_ok=True)
    dead = parent / f".tmp-{_folder().name}-{checkpoint_cache.socket.gethostname()}-999999999-deadbeef"
    dead.mkdir()
    (dead / WEIGHTS).write_bytes(b"half written")
    LazyEngine.from_pretrained(**KW)
    assert conversions == [loader.DEFAULT_MODEL_FILE] and not dead.exists()


def test_an_unwritable_cache_still_loads(conversions, tmp_path, monkeypatch, caplog, default_engine):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(blocker))  # a file where the folder should be: nothing can be written
    with caplog.at_level(logging.WARNING, logger="lazyrag.model.checkpoint_cache"):
        engine = LazyEngine.from_pretrained(**KW)
    assert engine.fingerprint == default_engine.fingerprint
    assert "could not write the model cache" in caplog.text and "LAZYRAG_MODEL_CACHE=0" in caplog.text


@pytest.mark.parametrize("switch", ["env", "argument"])
def test_the_cache_can_be_turned_off(conversions, monkeypatch, default_hf, default_engine, switch):
    loads = []
    monkeypatch.setattr(
        "lazyrag.engine.engine.load_checkpoint", lambda source, dtype: loads.append(source) or default_hf
    )
    kw = dict(KW)
    if switch == "env":
        monkeypatch.setenv("LAZYRAG_MODEL_CACHE", "0")
    else:
        kw["model_cache"] = False
    engine = LazyEngine.from_pretrained(**kw)
    assert loads and not conversions and not _folder().exists(), "the cache was used although turned off"
    assert engine.fingerprint == default_engine.fingerprint


def test_the_argument_overrides_the_environment(conversions, monkeypatch):
    monkeypatch.setenv("LAZYRAG_MODEL_CACHE", "0")
    LazyEngine.from_pretrained(model_cache=True, **KW)
    assert conversions and (_folder() / MANIFEST).is_file()


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LAZYRAG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert checkpoint_cache.models_dir() == tmp_path / "xdg" / "lazyrag" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert checkpoint_cache.models_dir() == tmp_path / "home" / ".cache" / "lazyrag" / "models"
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "mine"))
    assert checkpoint_cache.models_dir() == tmp_path / "mine" / "models"


def test_a_rewritten_gguf_is_hashed_again_even_with_its_old_size_and_mtime(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"a" * 1000)
    before = path.stat()
    first = checkpoint_cache.gguf_sha256(path)
    assert checkpoint_cache.gguf_sha256(path) == first  # remembered
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: only the ctime moved
    assert checkpoint_cache.gguf_sha256(path) != first


# -- warm-up -------------------------------------------------------------------------------------


def _state(engine: LazyEngine) -> dict:
    """Everything a request leaves behind in an engine: cached segments, blocks, counters, registered chunk texts."""
    return {
        "report": engine.cache_report(),
        "segments": len(engine.cache),
        "free": engine.cache.pool.num_free,
        "steps": dict(engine.scheduler.steps),
        "forwarded": engine.runner.tokens_forwarded,
        "flushed": engine.scheduler.planner.batch.tokens_flushed,
        "texts": len(engine.chunk_finder),
        "host": [len(t) for t in engine.cache.tiers],
        "busy": engine.has_unfinished_requests(),
    }


def test_warm_up_leaves_no_state_behind(default_hf):
    hf, tokenizer = default_hf
    engine = LazyEngine.from_hf(hf, tokenizer, device="cpu", kv_budget=32 << 20, cache=CacheConfig(host_bytes=16 << 20))
    fresh = _state(engine)
    assert fresh["free"] == engine.cache.pool.num_blocks and fresh["segments"] == 0
    forwarded = []
    engine.runner.model.register_forward_hook(lambda *a: forwarded.append(1))
    engine.warm_up()
    assert forwarded, "the warm-up ran no forward pass"
    assert _state(engine) == fresh
    r = engine.generate(
        "Who discovered penicillin?", ["Alexander Fleming discovered penicillin in 1928."], max_new_tokens=4
    )
    assert r.stats.chunks_hit == 0 and r.stats.prefix_tokens_reused == 0  # nothing the warm-up encoded is found


def test_from_pretrained_warms_up_unless_told_not_to(conversions, monkeypatch):
    warmed = []
    monkeypatch.setattr(LazyEngine, "warm_up", lambda self: warmed.append(self))
    engine = LazyEngine.from_pretrained(**{**KW, "warmup": True})
    assert warmed == [engine]
    LazyEngine.from_pretrained(**KW)
    assert warmed == [engine]


def test_warm_up_refuses_an_engine_in_use(tiny_hf, default_hf):
    engine = LazyEngine.from_hf(tiny_hf, default_hf[1], device="cpu", kv_budget=16 << 20)
    engine.precache(["Basalt is a volcanic rock that forms when lava cools quickly."])
    before = _state(engine)
    with pytest.raises(ValueError, match="new engine"):
        engine.warm_up()
    assert _state(engine) == before


def test_a_tuned_load_caches_the_merged_model_apart_from_the_base(tmp_path, monkeypatch, default_hf):
    # an adapter is merged once, at the conversion: the next load of the tuned model reads no GGUF and merges nothing,
    # and it is the same model as a merge in the loading process (cache off), fingerprint and logits
    import copy

    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LAZYRAG_MODEL_CACHE", raising=False)
    fresh = lambda source, dtype: (copy.deepcopy(default_hf[0]), default_hf[1])  # noqa: E731 - merging edits it
    monkeypatch.setattr(checkpoint_cache, "load_checkpoint", fresh)
    monkeypatch.setattr("lazyrag.engine.engine.load_checkpoint", fresh)
    merged_here = LazyEngine.from_pretrained(adapter="embedded", model_cache=False, **KW)
    assert not (tmp_path / "cache").exists()

    first = LazyEngine.from_pretrained(adapter="embedded", **KW)
    tuned_folder = cache_folder(loader.default_model_source(), torch.float32, "embedded")
    assert tuned_folder != _folder() and (tuned_folder / MANIFEST).is_file() and not _folder().exists()
    assert json.loads((tuned_folder / MANIFEST).read_text())["adapter_sha256"]
    _no_gguf_reads(monkeypatch)
    monkeypatch.setattr("lazyrag.tune.adapter.apply_adapter", lambda *a: pytest.fail("merged again"))
    second = LazyEngine.from_pretrained(adapter="embedded", **KW)
    assert second.fingerprint == first.fingerprint == merged_here.fingerprint
    assert second.model_name == merged_here.model_name == f"{loader.DEFAULT_MODEL_FILE}+smollm2-135m-instruct-lazy"
    layout = second.build_prompt("Who discovered penicillin?", ["Alexander Fleming discovered penicillin in 1928."])
    torch.testing.assert_close(second.layout_logits(layout, "lazy"), merged_here.layout_logits(layout, "lazy"))
    with pytest.raises(ValueError, match="not a LoRA adapter"):  # a cache miss still checks what it merges
        LazyEngine.from_pretrained(adapter=str(tmp_path / "cache"), **KW)
