"""The command line, as a user runs it."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import HANG_S

# runs the CLI, then says whether the engine module (torch, the model) was ever imported
_PROBE = (
    "import sys; from lazyrag.cli import main; rc = main(sys.argv[1:]); "
    "print('engine imported' if 'lazyrag.engine' in sys.modules else 'no engine', "
    "'torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)"
)


def run(*args, timeout=HANG_S):
    return subprocess.run([sys.executable, "-m", "lazyrag.cli", *args], capture_output=True, text=True, timeout=timeout)


def probe(*args, timeout=HANG_S):
    return subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=timeout)


def test_help_teaches():
    r = run("--help")
    assert r.returncode == 0
    assert "lazyrag demo" in r.stdout and "strategies" in r.stdout


def test_help_imports_no_torch():
    for args in (["--help"], ["precache", "--help"], ["ask", "--help"]):
        code = (
            "import sys; from lazyrag.cli import main\n"
            "try: main(sys.argv[1:])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules)"
        )
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=HANG_S)
        assert r.stdout.strip().endswith("False"), (args, r.stdout[-300:], r.stderr[-300:])


def test_demo_marks_each_strategys_answer_and_compares_ttft():
    r = run("demo", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "Right answers and time to first token" in out and "TTFT" in out
    answers = [
        line for line in out.splitlines() if line.rstrip().endswith(" ms") and ("right" in line or "wrong" in line)
    ]
    assert len(answers) == 8 * 3  # 8 questions x (full, lazy, the recovery)
    for strategy in ("full", "lazy", "lazy+recover"):
        assert sum(line.split()[0] == strategy for line in answers) == 8
    assert "right" in out and "Q8" in out


def test_python_dash_m_lazyrag_is_the_command():
    r = subprocess.run([sys.executable, "-m", "lazyrag", "--help"], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "lazyrag demo" in r.stdout and "serve" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "lazyrag", "demo", "--strategies", "lazy"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert r.returncode == 2 and "must include full" in r.stderr


def test_serve_checks_its_arguments_before_loading_the_model():
    r = probe("serve", "--port", "0")
    assert r.returncode == 2 and "--port" in r.stderr and "no torch" in r.stdout
    r = probe("serve", "--strategy", "nope")
    assert r.returncode == 2 and "no torch" in r.stdout
    r = probe("serve", "--host-gb", "-1")
    assert r.returncode == 2 and "--host-gb" in r.stderr and "no torch" in r.stdout
    r = run("serve", "--help")
    assert r.returncode == 0 and "/v1/chat/completions" in r.stdout and "documents" in r.stdout


def test_ask_reports_reuse_and_errors_clearly(tmp_path):
    r = run("ask", "Who?", "--chunks-file", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run("ask", "Who?", "--model", str(tmp_path / "no-model"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run(
        "ask",
        "Who found penicillin?",
        "--chunk",
        "Alexander Fleming found penicillin in 1928 in London.",
        "--max-new-tokens",
        "3",
    )
    assert r.returncode == 0 and "chunks hit 0, missed 1" in r.stderr
    assert "Loading weights" not in r.stderr and "GGUF" not in r.stderr  # no loading bars unless -v


def _broken_store(tmp_path):
    store = tmp_path / "broken"
    store.mkdir()
    (store / "manifest.json").write_text("{not json")
    return store


@pytest.mark.parametrize(
    "args, message",
    [
        (["ask", "Who?", "--chunk", "x", "--strategy", "lazzy"], "Unknown strategy 'lazzy'"),
        (["ask", "Who?", "--strategy", "lazy:first=x"], "lazy:first=K"),
        (["ask", "Who?", "--store", "{tmp}/missing"], "not a lazyrag store"),
        (["ask", "Who?", "--store", "{broken}"], ""),
        (["precache", "{tmp}/no-corpus", "--out", "{tmp}/out"], "not found"),
        (["precache", "{tmp}", "--out", "{tmp}/out", "--chunk-tokens", "100"], "multiple of the KV block size"),
        (["eval", "--strategies", "full,lazy:blend=2"], "Bad strategy"),
        (["serve", "--replicas", "2", "--tensor-parallel-size", "2"], "not supported yet"),
    ],
    ids=[
        "unknown-strategy",
        "bad-lazy-option",
        "missing-store",
        "broken-store",
        "missing-corpus",
        "chunk-tokens-off-block",
        "bad-eval-strategy",
        "replicas-with-tensor-parallel",
    ],
)
def test_bad_arguments_are_reported_before_any_model_loads(tmp_path, args, message):
    broken = _broken_store(tmp_path)
    args = [a.format(tmp=tmp_path, broken=broken) for a in args]
    r = probe(*args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and message in r.stderr and "--debug" in r.stderr
    assert "Traceback" not in r.stderr and "engine imported" not in r.stdout


def test_debug_shows_the_traceback(tmp_path):
    r = probe("ask", "Who?", "--store", str(tmp_path / "missing"), "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "StoreError" in r.stderr


def test_unfinished_store_says_how_to_finish(tmp_path, tiny_store):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    manifest = json.loads((tiny_store / "manifest.json").read_text())
    (unfinished / "manifest.json").write_text(json.dumps({**manifest, "status": "building"}))
    r = probe("ask", "Who?", "--store", str(unfinished))
    assert r.returncode == 2 and "rerun the same lazyrag precache command" in r.stderr and "Traceback" not in r.stderr


def test_precache_on_a_finished_store_returns_without_loading_the_model(tiny_store, tiny_corpus, tmp_path):
    from lazyrag.model.loader import resolve_model_source

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    manifest = json.loads((store / "manifest.json").read_text())  # as `lazyrag precache` names the default model
    (store / "manifest.json").write_text(json.dumps({**manifest, "model_name": resolve_model_source(None).name}))
    r = probe("precache", str(tiny_corpus), "--out", str(store))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already a finished store" in r.stdout and "engine imported" not in r.stdout
    other = probe("precache", str(tiny_corpus), "--out", str(store), "--chunk-tokens", "128")
    assert other.returncode == 2 and "other settings" in other.stderr  # not mistaken for done: the build explains
    int8 = probe("precache", str(tiny_corpus), "--out", str(store), "--stored-kv-dtype", "int8")
    assert int8.returncode == 2 and "stored_kv_dtype: store has 'float16', expected 'int8'" in int8.stderr


def test_strategy_names_checked_without_torch_are_the_engine_s():
    from lazyrag.engine.reuse import STRATEGIES
    from lazyrag.strategy_names import STRATEGY_NAMES

    assert tuple(STRATEGIES) == STRATEGY_NAMES


def test_encoding_passage_follows_the_store_unless_given(tmp_path):
    from argparse import Namespace
    from types import SimpleNamespace

    from lazyrag.cli.common import passage_kwargs

    def store(ids, text):
        return SimpleNamespace(manifest=SimpleNamespace(passage_ids=ids, encoding_passage=text))

    old, mine, untold = store([], ""), store([1, 2, 3], "A made-up town."), store([1, 2, 3], "")
    # built before passages
    assert passage_kwargs(Namespace(encoding_passage=None, store=old)) == {"encoding_passage": None}
    assert passage_kwargs(Namespace(encoding_passage=None, store=mine)) == {"encoding_passage": "A made-up town."}
    # the default; the store refuses it if it differs
    assert passage_kwargs(Namespace(encoding_passage=None, store=untold)) == {}
    # asked for: the store then refuses, saying why
    assert passage_kwargs(Namespace(encoding_passage="default", store=old)) == {}
    assert passage_kwargs(Namespace(encoding_passage="none")) == {"encoding_passage": None}
    assert passage_kwargs(Namespace(encoding_passage=None, store=None)) == {}
    text = tmp_path / "passage.txt"
    text.write_text("  First made-up document.\n\nSecond one.\n")
    assert passage_kwargs(Namespace(encoding_passage=str(text))) == {
        "encoding_passage": "First made-up document.\n\nSecond one."
    }
    (tmp_path / "empty.txt").write_text("\n")
    for bad, says in (
        (tmp_path / "missing.txt", "not default, none or a text file"),
        (tmp_path / "empty.txt", "empty"),
    ):
        with pytest.raises(SystemExit, match=says):
            passage_kwargs(Namespace(encoding_passage=str(bad)))


def test_k_is_capped_before_anything_loads():
    for args in (["ask", "q", "--k", "2147483648"], ["ask", "q", "--k", "0"], ["eval", "--k", "100000"]):
        r = probe(*args)
        assert r.returncode == 2 and "--k" in r.stderr and "no torch" in r.stdout, (
            args,
            r.stdout[-300:],
            r.stderr[-500:],
        )


# -- issue 34: lazyrag cache, defaults in --help, eval --out, quiet GGUF loading -------------------


def test_cache_shows_a_store_without_loading_a_model(tiny_store, tmp_path):
    r = probe("cache", "--store", str(tiny_store), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert "no engine" in r.stdout  # the manifest and the folder are read, no model
    assert report["status"] == "complete" and report["entries"] > 0 and report["tokens"] > 0
    assert report["dtype"] == "float32" and report["model"] and 0 < report["kv_bytes"] <= report["bytes_on_disk"]
    table = run("cache", "--store", str(tiny_store))
    assert (
        table.returncode == 0
        and "entries" in table.stdout
        and "bytes on disk" in table.stdout
        and "float32" in table.stdout
    )
    missing = probe("cache", "--store", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "not a corpus store" in missing.stderr and "lazyrag precache" in missing.stderr


def test_every_subcommand_s_help_shows_its_defaults():
    from lazyrag.cli import build_parser

    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        text = "".join(sub.format_help().split())  # without the line wrapping
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, [], "==SUPPRESS==") and action.help:
                assert "default" in action.help or f"(default:{action.default})".replace(" ", "") in text, (
                    name,
                    action.option_strings,
                )
    assert "(default:lazyrag-eval/quality.json)" in "".join(run("eval", "--help").stdout.split())


def test_precache_and_eval_quiet_the_gguf_bar_only(monkeypatch):
    from lazyrag.cli import _quiet_loading
    from lazyrag.defaults import QUIET_GGUF_ENV

    for name in (QUIET_GGUF_ENV, "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    _quiet_loading("precache")
    import os

    assert os.environ.get(QUIET_GGUF_ENV) == "1" and "TQDM_DISABLE" not in os.environ  # the run's own bars stay
    from transformers import modeling_gguf_pytorch_utils as gguf

    from lazyrag.model.loader import _quiet_gguf_bar

    original = gguf.tqdm
    with _quiet_gguf_bar(True):
        assert gguf.tqdm(range(3)).disable  # the GGUF reader's bar only
    assert gguf.tqdm is original


@pytest.mark.parametrize("argv", [["ask", "q"], ["serve"], ["demo"], ["precache", "docs", "--out", "store"], ["eval"]])
def test_no_model_cache_reaches_every_engine_the_command_makes(monkeypatch, argv):
    import os

    from lazyrag import cli
    from lazyrag.defaults import MODEL_CACHE_ENV

    monkeypatch.setenv(MODEL_CACHE_ENV, "1")  # restored after the test
    seen = []
    monkeypatch.setattr(cli, "_run", lambda args: seen.append(os.environ[MODEL_CACHE_ENV]) or 0)  # checks and run
    assert cli.main(argv) == 0 and seen == ["1"]
    assert cli.main([*argv, "--no-model-cache"]) == 0 and seen == ["1", "0"]


def test_serve_says_what_it_loads_and_when_it_is_ready(monkeypatch, capsys, default_engine):
    from lazyrag import cli, server
    from lazyrag.engine import LazyEngine

    loaded = []
    monkeypatch.setattr(LazyEngine, "from_pretrained", lambda model, **kw: loaded.append(kw) or default_engine)
    monkeypatch.setattr(server, "run_server", lambda *a, **k: None)
    assert cli.main(["serve", "--port", "8123"]) == 0
    err = capsys.readouterr().err
    assert loaded and "lazyrag serve: loading SmolLM2-135M-Instruct.Q4_1.gguf... ready in " in err
    assert "http://127.0.0.1:8123/v1" in err


# -- issue 43: serve shaped like `vllm serve` -----------------------------------------------------


def test_serve_takes_the_model_positionally_or_by_flag_not_both(tmp_path, monkeypatch):
    from lazyrag.cli import build_parser

    args = build_parser().parse_args(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "8001"])
    assert args.model_tag == "HuggingFaceTB/SmolLM2-135M-Instruct" and args.model is None and args.port == 8001
    r = probe("serve", "org/one", "--model", "org/two")
    assert r.returncode == 2 and "Two models given" in r.stderr and "no torch" in r.stdout
    # a hub id is looked up in the local Hugging Face cache only, before anything loads, and the error says how to get
    # it
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    for argv in (["serve", "org/not-here"], ["ask", "q", "--model", "org/not-here"]):
        r = probe(*argv)
        assert r.returncode == 2 and "not a model in the local Hugging Face cache" in r.stderr, r.stderr[-500:]
        assert "hf download org/not-here" in r.stderr and "no torch" in r.stdout


def test_serve_cache_admission_and_host_tier_reach_the_cache_manager():
    from dataclasses import replace

    import torch

    from lazyrag.cli import build_parser
    from lazyrag.cli.serve import _cache_fields
    from lazyrag.kv.block_pool import BlockPool, KVShape
    from lazyrag.kv.cache import CacheConfig, CacheManager

    args = build_parser().parse_args(["serve", "--cache-admission", "--host-gb", "0.5"])
    config = CacheConfig(**_cache_fields(args))
    assert config.admission and config.host_bytes == 512 << 20 and config.policy == "lru"
    assert _cache_fields(build_parser().parse_args(["serve"])) == {}  # LRU alone, no host tier, unless asked
    manager = CacheManager(
        BlockPool(
            KVShape(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32), 4, torch.device("cpu")
        ),
        replace(config, host_bytes=0),
    )
    assert manager.sketch is not None


def test_serve_config_file_gives_defaults_the_command_line_overrides(tmp_path):
    from lazyrag.cli import build_parser
    from lazyrag.cli.common import with_config

    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: org/from-file\nport: 8123\nmax_num_seqs: 7\nmax-model-len: 2048\n"
        "allowed_origins: ['http://a.example', 'http://b.example']\nno-pasted-context: true\n"
        "served_model_name: [first, second]\nuvicorn_log_level: warning\n"
    )
    parser = build_parser()

    def parsed(*argv):
        argv = list(argv)
        return with_config(parser, argv, parser.parse_args(argv))

    args = parsed("serve", "--config", str(config), "--port", "9000")
    assert args.port == 9000 and args.max_num_seqs == 7 and args.max_model_len == 2048  # the command line wins
    assert args.allowed_origins == ["http://a.example", "http://b.example"] and args.pasted_context is False
    assert (
        args.served_model_name == ["first", "second"] and args.log_level == "warning" and args.model == "org/from-file"
    )
    args = parsed("serve", "org/typed", "--config", str(config))
    assert args.model_tag == "org/typed" and args.model is None  # MODEL on the command line wins over the file's
    # --allowed-origins: vLLM's JSON list, or commas
    assert parser.parse_args(["serve", "--allowed-origins", "http://a.example, http://b.example"]).allowed_origins == [
        "http://a.example",
        "http://b.example",
    ]
    assert parser.parse_args(["serve", "--allowed-origins", "*"]).allowed_origins == ["*"]

    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 8001\nmax_num_seq: 3\nbogus: 1\n")
    r = probe("serve", "--config", str(bad))
    assert r.returncode == 2 and "unknown key(s) max_num_seq, bogus" in r.stderr and "max-num-seqs" in r.stderr
    assert "no torch" in r.stdout
    flag = tmp_path / "flag.yaml"
    flag.write_text("no-pasted-context: maybe\n")
    r = probe("serve", "--config", str(flag))
    assert r.returncode == 2 and "true or false" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--max-model-len", "0"], "--max-model-len must be at least 1"),
        (["serve", "--max-num-seqs", "-1"], "--max-num-seqs must be at least 1"),
        (["serve", "--ssl-keyfile", "{tmp}/key.pem"], "is not a file"),
        (["serve", "--root-path", "api"], "must start with /"),
    ],
    ids=["max-model-len", "max-num-seqs", "ssl-keyfile", "root-path"],
)
def test_serve_checks_vllm_s_flags_before_loading(tmp_path, args, message):
    r = probe(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2 and message in r.stderr and "no torch" in r.stdout, r.stderr[-500:]


def test_serve_passes_vllm_s_flags_to_the_engine_the_app_and_uvicorn(monkeypatch, capsys, default_engine, tmp_path):
    from lazyrag import cli, server
    from lazyrag.engine import LazyEngine

    model = tmp_path / "My-Model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    loaded, served = [], []
    monkeypatch.setattr(LazyEngine, "from_pretrained", lambda model, **kw: loaded.append((model, kw)) or default_engine)
    monkeypatch.setattr(server, "run_server", lambda *a, **k: served.append((a, k)))
    cert = tmp_path / "cert.pem"
    cert.write_text("-")
    assert (
        cli.main(
            [
                "serve",
                str(model),
                "--max-num-seqs",
                "3",
                "--max-num-batched-tokens",
                "512",
                "--long-prefill-token-threshold",
                "256",
                "--max-model-len",
                "1024",
                "--allowed-origins",
                '["http://ui.example"]',
                "--ssl-certfile",
                str(cert),
                "--root-path",
                "/api/",
                "--uvicorn-log-level",
                "debug",
                "--seed",
                "11",
            ]
        )
        == 0
    )
    ((path, kw),) = loaded
    assert path == str(model) and kw["scheduler"].max_running == 3 and kw["scheduler"].max_prefill_tokens == 512
    assert kw["scheduler"].long_prefill_tokens == 256
    (engine, config, host, port, retriever, log_level), options = served[0]
    assert config.max_model_len == 1024 and config.allowed_origins == ("http://ui.example",) and log_level == "debug"
    # vLLM's served name: MODEL as written; the engine's own name (and its aliases) still answer
    assert config.model_name == str(model) and engine.model_name in config.aliases
    assert options == {"ssl_certfile": str(cert), "root_path": "/api"}
    assert "https://127.0.0.1:8000/api/v1" in capsys.readouterr().err
    import torch

    first = torch.rand(3)
    cli.main(["serve", "--seed", "11"])
    assert torch.equal(torch.rand(3), first)  # --seed seeds torch's generator once the model is loaded


def test_serve_reads_its_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """A key on the command line shows in `ps`: --api-key-file and $LAZYRAG_API_KEY keep it out of sight."""
    from lazyrag.cli import build_parser
    from lazyrag.cli.common import UsageError
    from lazyrag.cli.serve import _api_key

    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    monkeypatch.delenv("LAZYRAG_API_KEY", raising=False)
    args = parse()
    _api_key(args)
    assert args.api_key is None
    monkeypatch.setenv("LAZYRAG_API_KEY", "from-env")
    args = parse()
    _api_key(args)
    assert args.api_key == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    args = parse("--api-key-file", str(tmp_path / "key"))
    _api_key(args)
    assert args.api_key == "from-file"
    args = parse("--api-key", "flag")
    _api_key(args)
    assert args.api_key == "flag"  # the flag wins over the variable
    for bad, says in (
        (["--api-key", "a", "--api-key-file", str(tmp_path / "key")], "once"),
        (["--api-key-file", str(tmp_path / "none")], "No such file"),
        (["--api-key", " "], "empty"),
    ):
        with pytest.raises(UsageError, match=says):
            _api_key(parse(*bad))


def test_budgets_take_one_size_syntax_everywhere():
    """--kv-budget of serve, precache and eval, and EngineConfig.kv_budget: 4GiB, 512MB, 1.5G, or a bare number of
    GiB (bytes when it is 2^20 or more, as the flag took before units)."""
    from lazyrag.cli import build_parser
    from lazyrag.engine import EngineConfig
    from lazyrag.sizes import parse_bytes

    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("1.5G") == 3 << 29
    assert parse_bytes("2") == 2 << 30 and parse_bytes(8589934592) == 8 << 30 and parse_bytes("64mib") == 64 << 20
    for bad in ("", "4 parsecs", "-1G", True, "1e9"):
        with pytest.raises(ValueError, match="4GiB, 512MB or 1.5G"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="more than 0 bytes"):
        parse_bytes("0")
    for command in (["serve"], ["precache", "docs/", "--out", "s"], ["eval"]):
        assert build_parser().parse_args([*command, "--kv-budget", "512MiB"]).kv_budget == 512 << 20
        assert build_parser().parse_args([*command, "--kv-budget", "3"]).kv_budget == 3 << 30
    assert EngineConfig(device="cpu", kv_budget="256MiB").kv_budget == 256 << 20
