"""`lazyrag eval`: SQuAD-style scoring and the batched side-by-side evaluation."""

import sys
from pathlib import Path

import pytest

from lazyrag.eval import DATA, accuracy, evaluate, exact_match, f1, normalize, score_parallel
from tests.helpers import CHUNKS


def test_squad_scoring():
    assert normalize("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("the Eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("It is the Eiffel tower", ["Eiffel Tower"]) == 0.0
    assert accuracy("It is the Eiffel tower", ["Louvre", "Eiffel Tower"]) == 1.0
    assert f1("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    assert f1("", ["Paris"]) == 0.0


def test_batched_evaluation_matches_one_request_at_a_time(default_engine):
    items = [
        {"question": "Who won Nobel Prizes in 1903 and 1911?", "answers": ["Marie Curie"], "chunks": CHUNKS[:3]},
        {"question": "How deep is the Mariana Trench?", "answers": ["10,935 metres"], "chunks": CHUNKS[1:4]},
        {"question": "Where was Paganini born?", "answers": ["Genoa"], "chunks": CHUNKS[2:]},
    ]
    strategies = ["full", "position_aware", "lazy"]
    out = evaluate(default_engine, items, strategies, max_new_tokens=6, progress=False, batch_items=2)
    for s in strategies:
        alone = [
            default_engine.generate(it["question"], it["chunks"], max_new_tokens=6, strategy=s).text.strip()
            for it in items
        ]
        assert out["answers"][s] == alone
    summary = out["summary"]
    assert summary["lazy"]["identical_to_position_aware_pct"] == 100.0
    assert summary["full"]["prefilled_pct_of_prompt"] == 100.0
    assert summary["lazy"]["prefilled_pct_of_prompt"] < 50  # the question tails only
    assert 0 <= summary["full"]["accuracy"] <= 100


def test_worker_processes_give_the_same_rows_in_item_order(default_engine):
    """``--workers``: items are scored in spawned processes, each with its own engine; the rows come back in item
    order and each is the answer a single engine gives."""
    items = [
        {"question": q, "answers": ["x"], "chunks": CHUNKS[i : i + 2]}
        for i, q in enumerate(
            ["Who won Nobel Prizes in 1903 and 1911?", "How deep is the Mariana Trench?", "Where was Paganini born?"]
        )
    ]
    rows = score_parallel(
        {"device": "cpu"}, items, ["lazy"], max_new_tokens=4, batch_items=1, workers=2, progress=False
    )["lazy"]
    assert [r["question"] for r in rows] == [it["question"] for it in items]
    alone = [
        default_engine.generate(it["question"], it["chunks"], max_new_tokens=4, strategy="lazy").text.strip()
        for it in items
    ]
    assert [r["answer"] for r in rows] == alone


@pytest.mark.skipif(
    not (DATA / "nq_open_oracle_2655.jsonl.gz").is_file(), reason="the shared NQ data is not beside this checkout"
)
def test_eval_command_writes_json_and_plot(tmp_path):
    import json

    from lazyrag.cli import main

    out = tmp_path / "q.json"
    assert (
        main(
            [
                "eval",
                "--dataset",
                "nq",
                "--n",
                "2",
                "--strategies",
                "lazy,position_aware",
                "--max-new-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["n"] == 2 and set(result["summary"]) == {"lazy", "position_aware"}
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.skipif(
    not (DATA / "nq_open_oracle_2655.jsonl.gz").is_file(), reason="the shared NQ data is not beside this checkout"
)
def test_an_interrupted_eval_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    """Each batch is saved as it finishes; ``--resume`` scores only the items left and reports them all;
    a partial file of other options is refused with a message that says what to do."""
    import json

    from lazyrag import eval as quality
    from lazyrag.cli import main

    out = tmp_path / "q.json"
    options = {
        "--dataset": "nq",
        "--n": "2",
        "--batch": "1",
        "--strategies": "lazy",
        "--max-new-tokens": "2",
        "--out": str(out),
    }
    args = ["eval", *(x for kv in options.items() for x in kv)]
    real, seen = quality._score_group, []

    def interrupted_after_one(engine, group, *rest):
        if len(seen) == 1:
            raise KeyboardInterrupt  # a killed run
        seen.append(group[0]["question"])
        return real(engine, group, *rest)

    monkeypatch.setattr(quality, "_score_group", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    partial = out.with_suffix(".partial.jsonl")
    assert len(partial.read_text().splitlines()) == 2  # the run's options, then the one batch done
    other = ["eval", *(x for k, v in options.items() for x in (k, "full,lazy" if k == "--strategies" else v))]
    assert main(other + ["--resume"]) == 2  # other strategies: refused, nothing run
    assert "differs in strategies" in capsys.readouterr().err and len(seen) == 1
    # a file written under another text of the default passage (an older release's) says so, though both read "default"
    header, *done = partial.read_text().splitlines()
    run = json.loads(header)
    assert run["encoding_passage"] == "default" and len(run["encoding_passage_sha256"]) == 64
    partial.write_text("\n".join([json.dumps({**run, "encoding_passage_sha256": "0" * 64}), *done]) + "\n")
    assert main(args + ["--resume"]) == 2
    assert "differs in encoding_passage_sha256" in capsys.readouterr().err and len(seen) == 1
    assert main(args + ["--resume", "--adapter", "embedded"]) == 2  # the base model's rows, not the tuned one's
    assert "differs in adapter_sha256" in capsys.readouterr().err and len(seen) == 1
    partial.write_text("\n".join([header, *done]) + "\n")

    monkeypatch.setattr(
        quality,
        "_score_group",
        lambda engine, group, *rest: (seen.append(group[0]["question"]), real(engine, group, *rest))[1],
    )
    assert main(args + ["--resume"]) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 2 and result["resumed"] == 1 and len(seen) == 2  # only the second item ran
    assert result["questions"] == seen and len(result["answers"]["lazy"]) == 2
    assert not partial.exists()  # complete: everything is in --out


@pytest.mark.parametrize("dataset", ["nq", "hotpotqa", "squad", "2wiki", "musique"])
def test_every_set_splits_into_fixed_disjoint_tune_and_report_parts(dataset):
    """Methods are chosen on ``tune`` and reported on ``report``: the parts never share a question, together they
    are the whole set, about 30/70, the same whatever --n or seed asks for; every item has its answers and
    several chunks."""
    from lazyrag.eval import default_data, load_dataset, split_of

    path = default_data(dataset)
    if not path.is_file():
        pytest.skip(f"{path} is not here (nq and hotpotqa live in ../shared/data)")
    every = load_dataset(dataset, path, 10**6, seed=3)
    tune = load_dataset(dataset, path, 10**6, split="tune", seed=3)
    report = load_dataset(dataset, path, 10**6, split="report", seed=3)
    questions = lambda items: {it["question"] for it in items}  # noqa: E731
    assert not questions(tune) & questions(report)
    assert questions(tune) | questions(report) == questions(every)
    assert 0.25 < len(tune) / len(every) < 0.35
    assert all(split_of(it["question"]) == "tune" for it in tune)
    first = load_dataset(dataset, path, 20, split="report", seed=3)
    assert questions(first) <= questions(report) and len(first) == 20
    assert all(it["answers"] and all(isinstance(a, str) and a for a in it["answers"]) for it in every)
    assert all(len(it["chunks"]) >= 2 and all(c.strip() for c in it["chunks"]) for it in every)


def test_the_recovery_is_chosen_by_its_mean_paired_gain_over_the_sets():
    """benchmarks/quality_sets.py: paired differences per set, and the rule that picks the recovery on the tune
    splits (the best mean accuracy difference over the sets, at most 15% recomputed on every set)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "quality_sets", Path(__file__).parents[1] / "benchmarks" / "quality_sets.py"
    )
    qs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qs)
    scores = {
        "full": {"acc": [1, 0, 1, 1], "f1": [0.5, 0.0, 0.4, 0.6]},
        "a": {"acc": [1, 0, 0, 1], "f1": [0.5, 0.1, 0.2, 0.6]},
    }
    rows = qs.paired(scores)
    assert rows["a"]["accuracy_minus_full"] == pytest.approx(-25.0)
    assert rows["a"]["accuracy_minus_full_se"] == pytest.approx(25.0)  # one question of four lost: sd 50, n 4
    assert rows["a"]["f1_minus_full"] == pytest.approx(-2.5)

    def row(acc, f1, recomputed):
        return {"accuracy_minus_full": acc, "f1_minus_full": f1, "recomputed_pct_of_chunk_tokens": recomputed}

    table = {
        "nq": {
            "full": row(0, 0, 0),
            "lazy": row(-7, -3, 0),
            "x": row(-1, -0.5, 14),
            "y": row(-3, -1, 14),
            "z": row(0, 0, 20),
        },
        "squad": {
            "full": row(0, 0, 0),
            "lazy": row(-6, -2, 0),
            "x": row(-3, -0.2, 14),
            "y": row(0.2, 0.1, 15),
            "z": row(0, 0, 20),
        },
    }
    winner, means = qs.choose(table, 15.0)
    assert set(means) == {"x", "y"}  # z recomputes too much, full and lazy are no candidates
    assert means["x"]["accuracy"] == pytest.approx(-2.0) and means["y"]["worst_accuracy"] == pytest.approx(-3.0)
    assert winner == "y"  # mean -1.4 against x's -2.0, though y is worse on nq
    table["nq"]["x"] = row(0.1, 0.5, 14)  # x's mean -1.45: within 0.1 of y's, and its F1 is higher
    assert qs.choose(table, 15.0)[0] == "x"


def test_skip_answered_leaves_out_what_every_strategy_answered_somewhere(tmp_path):
    import json

    from lazyrag.eval import answered_questions

    def report(name, questions, scores, errors=None):
        path = tmp_path / name
        path.write_text(
            json.dumps(
                {
                    "questions": questions,
                    "errors": errors or {},
                    "scores": {s: {"acc": [0.0] * len(questions), "f1": [0.0] * len(questions)} for s in scores},
                }
            )
        )
        return path

    first = report("a.json", ["q1", "q2", "q3"], ["full", "lazy"], errors={"lazy": {"1": "out of memory"}})
    later = report("b.json", ["q2", "q4"], ["full", "lazy", "lazy+recover"])
    # q2's lazy failed in the first report but was answered in the later one; only "lazy+recover" was asked later
    assert answered_questions([first, later], ["full", "lazy"]) == {"q1", "q2", "q3", "q4"}
    assert answered_questions([first, later], ["full", "lazy", "lazy+recover"]) == {"q2", "q4"}
    assert answered_questions([first], ["full", "lazy"]) == {"q1", "q3"}
    assert answered_questions([first], ["full", "position_aware"]) == set()  # a strategy no report ran


def test_eval_refuses_a_missing_skip_answered_report_before_loading_the_model(tmp_path, capsys):
    from lazyrag.cli import main

    assert main(["eval", "--dataset", "squad", "--skip-answered", str(tmp_path / "none.json")]) == 2
    assert "--skip-answered" in capsys.readouterr().err


def test_many_passages_pad_each_question_with_other_questions_passages():
    from lazyrag.eval import with_passages

    items = [{"question": f"q{i}", "answers": ["a"], "chunks": [f"own {i} a", f"own {i} b"]} for i in range(6)]
    padded = with_passages(items[:2], items, 5, seed=0)
    for item, out in zip(items, padded):
        assert len(out["chunks"]) == 5 and set(item["chunks"]) <= set(out["chunks"])
        assert len(set(out["chunks"])) == 5, "no passage twice"
    assert padded == with_passages(items[:2], items, 5, seed=0), "the same seed, the same prompts"
    assert [len(o["chunks"]) for o in with_passages(items[:1], items, 20, seed=0)] == [12], "as many as the set has"
    assert with_passages(items[:1], items, 1, seed=0)[0]["chunks"] in (items[0]["chunks"], items[0]["chunks"][::-1])


def test_an_answer_does_not_depend_on_the_other_strategies_in_the_run(tiny_engine, monkeypatch):
    """Each strategy's requests run as their own batch, so a question's batch (and, in bf16, its rounding) is the
    same whichever strategies a run compares."""
    from lazyrag.engine.scheduler import Scheduler
    from lazyrag.eval import score

    batches = []
    prefill = Scheduler._prefill

    def recording(self, batch):
        batches.append({r.params.strategy for r in batch})
        return prefill(self, batch)

    monkeypatch.setattr(Scheduler, "_prefill", recording)
    items = [
        {
            "question": f"Which river is in note {i}?",
            "answers": ["Orinoco"],
            "chunks": ["The Orinoco flows through Venezuela.", f"Note {i} is about rivers."],
        }
        for i in range(3)
    ]
    alone = score(tiny_engine, items, ["lazy"], 6, batch_items=3)["lazy"]
    together = score(tiny_engine, items, ["full", "lazy", "position_aware"], 6, batch_items=3)["lazy"]
    assert all(len(b) == 1 for b in batches), batches
    assert [r["answer"] for r in alone] == [r["answer"] for r in together]


def test_an_installed_lazyrag_evaluates_on_its_shipped_samples(tmp_path, monkeypatch, capsys):
    """From a wheel (no repository data beside it): squad, 2wiki and musique read the samples in the package, nq and
    hotpotqa say they need --data and what it holds, and the default dataset is one that runs."""
    from lazyrag import eval as quality

    monkeypatch.setattr(quality, "BENCH_DATA", tmp_path / "no-benchmarks")
    monkeypatch.setattr(quality, "DATA", tmp_path / "no-shared-data")
    for name in ("squad", "2wiki", "musique"):
        path = quality.default_data(name)
        assert path.parent == quality.SAMPLES and path.is_file()
        items = quality.load_dataset(name, path, 5)
        assert len(items) == 5 and all(it["question"] and it["answers"] and it["chunks"] for it in items)
    assert quality.run_eval(quality.EvalConfig(dataset="hotpotqa")) == 2
    assert "--data" in capsys.readouterr().err
    # the default: squad here (nq's file is not found), decided before any model loads
    loaded = []
    monkeypatch.setattr(quality, "load_dataset", lambda name, *a, **k: loaded.append(name) or sys.exit(7))
    with pytest.raises(SystemExit):
        quality.run_eval(quality.EvalConfig(n=2))
    assert loaded == ["squad"] and "evaluating on squad" in capsys.readouterr().err


def test_the_eval_command_builds_an_eval_config_with_the_library_s_defaults(tmp_path):
    """``lazyrag eval`` hands run_eval an EvalConfig: its flags' defaults are EvalConfig's, and each flag reaches
    its field (the size parsed, the strategies split, --encoding-passage read)."""
    from lazyrag.cli import build_parser
    from lazyrag.cli.eval import eval_config
    from lazyrag.eval import EvalConfig

    parse = build_parser().parse_args
    assert eval_config(parse(["eval"])) == EvalConfig()
    passage = tmp_path / "passage.txt"
    passage.write_text("A made-up town.\n")
    report = tmp_path / "earlier.json"
    argv = ["eval", "--dataset", "squad", "--n", "7", "--strategies", "full,lazy", "--kv-budget", "512MiB"]
    argv += ["--encoding-passage", str(passage), "--skip-answered", str(report), "--out", str(tmp_path / "q.json")]
    config = eval_config(parse(argv))
    assert (config.dataset, config.n, config.strategies, config.kv_budget) == ("squad", 7, ("full", "lazy"), 512 << 20)
    assert config.encoding_passage == "A made-up town." and config.skip_answered == (report,)
    assert config.out == tmp_path / "q.json"
    assert eval_config(parse(["eval", "--encoding-passage", "none"])).encoding_passage is None
    # from Python: strings where paths and lists go
    assert EvalConfig(strategies="full,lazy", out="q.json", data="d.jsonl") == EvalConfig(
        strategies=("full", "lazy"), out=Path("q.json"), data=Path("d.jsonl")
    )


def test_a_resumed_retrieval_run_names_its_store_by_its_folder(tmp_path):
    """The checkpoint's first line names the store by its folder whether it comes opened (the command opens it to
    check it) or as a path: a resumed ``--store`` run compares equal (an opened store's repr never did)."""
    from types import SimpleNamespace

    from lazyrag.eval import _store_path

    folder = tmp_path / "stores" / "nq"
    assert _store_path(SimpleNamespace(path=folder)) == _store_path(folder) == str(folder)


def test_strategies_that_read_cached_chunks_run_before_full_prefill_evicts_them(tiny_engine, tiny_hf, default_hf):
    """A group's chunks are encoded once, before its strategies run. Under a KV budget of about the group's chunks
    plus its prompts, ``full`` run first would evict some of them and ``lazy`` would encode them again (which the
    eval would count as its recompute, and on a GPU, pay for): the strategies that read cached chunks go first,
    whatever order the run names them in, and the rows keep that order."""
    from lazyrag.engine import LazyEngine
    from lazyrag.eval import score

    items = [
        {
            "question": f"Which river is in note {i}?",
            "answers": ["Orinoco"],
            "chunks": [f"Passage {j} of note {i}: " + "the Orinoco flows through Venezuela. " * 6 for j in range(4)],
        }
        for i in range(3)
    ]
    shape = tiny_engine.scheduler.pool.shape  # the same model's: the same block size and bytes a block
    layouts = [tiny_engine.build_prompt(it["question"], it["chunks"]) for it in items]
    chunk_blocks = sum(shape.blocks_for(len(c)) for layout in layouts for c in layout.chunk_ids)
    prompt_blocks = sum(shape.blocks_for(layout.num_tokens + 6) for layout in layouts)
    engine = LazyEngine.from_hf(
        tiny_hf, default_hf[1], device="cpu", kv_budget=(chunk_blocks + prompt_blocks + 8) * shape.bytes_per_block
    )
    rows = score(engine, items, ["full", "lazy"], 6, batch_items=3)
    assert list(rows) == ["full", "lazy"]
    assert [r["recompute_cost"] for r in rows["lazy"]] == [0, 0, 0], "lazy read the chunks the group encoded"
    assert [r["question"] for r in rows["full"]] == [it["question"] for it in items]
