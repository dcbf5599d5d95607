"""Tensor parallelism on CPU (issue 33): 2 gloo processes on a small random Llama against one process.

The multi-process runs happen in subprocesses (``tp_run.py``), so no process group outlives its test. No run races
the clock (issue 44): a run may take as long as a busy machine makes it; it fails as hung only once none of its
processes has had any CPU time for STALL_S (``wait_working``), which a slow run never reaches and a deadlock always
does. Logits are compared within a tolerance (the row-parallel all-reduce sums in another order than one matmul),
greedy answers token for token up to a near-tie that the other sum order may break the other way.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_family_model, tiny_llama_config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny random GQA Llama (4 query heads over 2 KV heads) saved as a checkpoint folder with a tokenizer:
    every rank loads it itself."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from lazyrag.model.loader import default_model_source

    torch.manual_seed(1234)
    hf = LlamaForCausalLM(tiny_llama_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.normal_(0, 0.2)  # random init keeps attention near uniform; larger weights make positions matter
    out = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(out)
    src = default_model_source()
    AutoTokenizer.from_pretrained(src.folder, **src.kwargs()).save_pretrained(out)
    return out


# A run is hung, not slow, once its processes together got less than STALL_CPU_S of CPU time in STALL_S: a run on a
# busy machine still gets its share (tens of ms a second with dozens of busy processes on 2 cores), one whose ranks
# all wait on each other gets none (their idle threads wake a few times a second for microseconds).
STALL_S, STALL_CPU_S = 120.0, 1.0
HAS_PROC = Path("/proc/self/stat").exists()
NO_PROC_TIMEOUT_S = 1800.0  # without Linux's /proc, a generous wall-clock guard against a hang instead


def _cpu_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU clock ticks it and its reaped children used) of every process (Linux /proc)."""
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # exited meanwhile
            continue
        f = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        procs[int(name)] = (int(f[1]), sum(int(x) for x in f[11:15]))  # utime, stime, cutime, cstime
    return procs


def _tree(root: int, procs: dict[int, tuple[int, int]]) -> list[int]:
    """``root`` and every process below it."""
    tree, i = [root], 0
    while i < len(tree):
        tree += [pid for pid, (parent, _) in procs.items() if parent == tree[i]]
        i += 1
    return [pid for pid in tree if pid in procs]


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and the processes below it (a reaped one's count in its parent's)."""
    procs = _cpu_ticks()
    return sum(procs[pid][1] for pid in _tree(root, procs)) / os.sysconf("SC_CLK_TCK")


def wait_working(done, cpu_s, what: str) -> None:
    """Wait until ``done()``, however long a busy machine makes it take; fail once ``cpu_s()`` (the CPU seconds used
    by what is waited for) grew by less than STALL_CPU_S in STALL_S: it is hung, not slow."""
    if not HAS_PROC:
        deadline = time.monotonic() + NO_PROC_TIMEOUT_S
        while not done():
            assert time.monotonic() < deadline, f"{what}: not done in {NO_PROC_TIMEOUT_S:.0f} s"
            time.sleep(0.5)
        return
    mark, since = cpu_s(), time.monotonic()
    while not done():
        time.sleep(0.5)  # a poll of observable state, not a wait for something to happen in time
        used = cpu_s()
        if used - mark >= STALL_CPU_S:
            mark, since = used, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            raise AssertionError(f"{what}: hung (less than {STALL_CPU_S} s of CPU time in {STALL_S:.0f} s)")


def run_process(cmd: list[str], env: dict[str, str], tmp: Path) -> tuple[int, str, str]:
    """Run ``cmd`` (in a process group of its own) to its end: (exit code, stdout, stderr). Output goes to files, so
    a process that writes much never blocks on a full pipe; a hung one (``wait_working``) is killed with everything
    it started, and fails the test with its output."""
    with open(tmp, "w+b") as out, open(tmp.with_suffix(".err"), "w+b") as err:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            wait_working(lambda: p.poll() is not None, lambda: tree_cpu_s(p.pid), " ".join(cmd[1:3]))
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the group this run started: rank 0 and its workers
            p.wait()
            err.seek(0)
            raise AssertionError(f"{e}\n{err.read().decode(errors='replace')[-3000:]}") from e
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def run(folder, out: Path, tp: int, mode: str) -> None:
    """Run tp_run.py to its end (never hangs: ``wait_working``); fails if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(HERE / "tp_run.py"), str(folder), str(out), str(tp), mode]
    code, _, stderr = run_process(cmd, env, out.with_name(f"{out.name}.log"))
    assert code == 0, stderr[-3000:]


# Two greedy answers of one model computed in two ways (one process; two ranks whose all-reduce sums the partial
# matmuls in another order) agree token for token, but where the best two tokens' logprobs lie within TIE_LOGPROB of
# each other either may win (the tiny random models' best two often lie ~1e-5 apart). Logits agree to ~1e-5 here.
TIE_LOGPROB = 1e-3


def assert_same_greedy_answer(got, expected, what: str) -> None:
    """``got`` and ``expected`` (tp_run.steps) are the same tokens up to where both runs saw a near-tie between the
    two tokens they chose; after it, each continues a different text and nothing is left to compare."""
    assert len(got) == len(expected), what
    for i, ((token, top), (want, want_top)) in enumerate(zip(got, expected)):
        if token == want:
            continue
        # a different token is a near-tie broken the other way: in each run the other's token is the runner-up
        for name, mine, other, top_two in (("one process", want, token, want_top), ("two ranks", token, want, top)):
            (first, p1), (second, p2) = top_two
            assert (first, second) == (mine, other), f"{what}: token {i} differs ({name}: {top_two})"
            assert p1 - p2 <= TIE_LOGPROB, f"{what}: token {i} differs, no near-tie ({name}: {top_two})"
        return


def assert_two_ranks_answer_as_one(a: dict, b: dict) -> set[str]:
    """A "strategies" run's results on one process (``a``) and on two ranks (``b``) agree: logits within a
    tolerance, greedy answers up to a near-tie, the rest (the seeded sample, the fingerprint) exactly. Returns the
    strategies whose logits were compared."""
    assert a.keys() == b.keys()
    strategies = set()
    for key in a:
        if key.endswith("/logits"):
            scale = a[key].abs().max().item()
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-4 * max(1.0, scale), msg=key)
            strategies.add(key.split("/")[0])
        elif key.endswith("/steps"):
            assert_same_greedy_answer(b[key], a[key], key)
        elif key == "batch/greedy":
            for i, (got, want) in enumerate(zip(b[key], a[key], strict=True)):
                assert_same_greedy_answer(got, want, f"{key}[{i}]")
        else:
            assert b[key] == a[key], key  # the seeded sample (same seed on every rank) and the fingerprint
    return strategies


def _exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # a zombie has exited; its parent died before reaping it


# -- in one process: the split's checks ------------------------------------------------------------


def test_split_must_divide_the_kv_heads():
    from lazyrag.model.llama import LlamaArgs
    from lazyrag.model.parallel import check_divisible, local_args

    args = LlamaArgs.from_hf(tiny_llama_config())
    assert local_args(args, 2).num_kv_heads == 1 and local_args(args, 2).num_heads == 2
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads"):
        check_divisible(args, 4)


def test_shard_slices_heads_and_columns():
    from lazyrag.model.llama import LlamaArgs
    from lazyrag.model.parallel import TensorParallel, shard_hf_state_dict

    cfg = tiny_llama_config(attention_bias=True)
    args = LlamaArgs.from_hf(cfg)
    d = args.head_dim
    sd = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(args.num_heads * d)[:, None].expand(-1, 64).float(),
        "model.layers.0.self_attn.k_proj.weight": torch.arange(args.num_kv_heads * d)[:, None].expand(-1, 64).float(),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(args.num_heads * d)[None, :].expand(64, -1).float(),
        "model.layers.0.self_attn.o_proj.bias": torch.ones(64),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(64, args.intermediate_size),
        "model.embed_tokens.weight": torch.zeros(10, 64),
    }
    r1 = shard_hf_state_dict(sd, args, TensorParallel(2, 1, None))
    assert r1["model.layers.0.self_attn.q_proj.weight"][:, 0].tolist() == list(range(2 * d, 4 * d))  # query heads 2, 3
    assert r1["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == list(range(d, 2 * d))  # KV head 1
    assert r1["model.layers.0.self_attn.o_proj.weight"][0].tolist() == list(range(2 * d, 4 * d))  # its input columns
    assert r1["model.layers.0.mlp.down_proj.weight"].shape == (64, args.intermediate_size // 2)
    assert not r1["model.layers.0.self_attn.o_proj.bias"].any()  # a row-parallel bias is added once, by rank 0
    r0 = shard_hf_state_dict(sd, args, TensorParallel(2, 0, None))
    assert r0["model.layers.0.self_attn.o_proj.bias"].eq(1).all() and r0["model.embed_tokens.weight"].shape == (10, 64)


def test_from_hf_cannot_spawn_workers_for_a_model_in_memory(tiny_hf):
    from lazyrag.engine import LazyEngine

    with pytest.raises(ValueError, match="from_pretrained"):
        LazyEngine.from_hf(tiny_hf, None, device="cpu", kv_budget=8 << 20, tensor_parallel_size=2)


def test_config_checks_the_size():
    from lazyrag.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s"):
        EngineConfig(device="cpu", tensor_parallel_timeout_s=0)


def test_a_rank_reads_its_heads_of_stored_kv():
    """A store holds every KV head (built by one process); a rank's pool takes its slice where the KV enters."""
    from lazyrag.kv.block_pool import BlockPool, KVShape
    from lazyrag.kv.cache import CacheManager

    pool = BlockPool(KVShape(2, 1, 4, 4, torch.float32), num_blocks=4, device=torch.device("cpu"))
    cache = CacheManager(pool)
    cache.kv_heads = (1, 2)  # rank 1 of 2 over 2 KV heads
    k = torch.randn(2, 6, 2, 4)  # [L, T, Hkv (all), D]
    v = torch.randn(2, 6, 2, 4)
    blocks = pool.allocate(2)
    cache.write_kv(blocks, k, v)
    got = pool.k[:, blocks].reshape(2, 8, 1, 4)[:, :6]
    assert torch.equal(got, k[:, :, 1:2]) and torch.equal(pool.v[:, blocks].reshape(2, 8, 1, 4)[:, :6], v[:, :, 1:2])


def test_a_store_is_built_by_one_process():
    from lazyrag.store.build import check_store_writer
    from lazyrag.store.corpus import StoreError

    class Sharded:
        tensor_parallel_size = 2

    check_store_writer(object())  # an engine of one process (or anything without the attribute) builds stores
    with pytest.raises(StoreError, match="tensor_parallel_size=1"):
        check_store_writer(Sharded())


@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied-embeddings"])
def test_a_rank_reads_only_its_shard_and_gets_the_whole_models_fingerprint(tiny_folder, tmp_path, tied):
    """``load_sharded`` streams a safetensors folder: the slices equal the whole state dict's, none keeps a whole
    tensor alive, and the fingerprint is the one-process engine's (so stores and caches match at any size)."""
    from transformers import LlamaForCausalLM

    from lazyrag.model.llama import LlamaArgs
    from lazyrag.model.loader import fingerprint, load_checkpoint, load_sharded, resolve_model_source
    from lazyrag.model.parallel import TensorParallel, shard_hf_state_dict, shard_tensor

    torch.manual_seed(5)
    LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied, attention_bias=True)).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer beside the weights, as checkpoints have
        (tmp_path / name).write_bytes((tiny_folder / name).read_bytes())
    source = resolve_model_source(str(tmp_path))
    hf, _ = load_checkpoint(source, torch.float32)
    whole = {k: v.detach() for k, v in hf.state_dict().items()}
    args = LlamaArgs.from_hf(hf.config)
    for rank in (0, 1):
        tp = TensorParallel(2, rank, None)
        _, state, fp = load_sharded(source, hf.config, torch.float32, lambda n, t, tp=tp: shard_tensor(n, t, args, tp))
        assert fp == fingerprint(hf.config, whole, torch.float32)
        expected = shard_hf_state_dict(whole, args, tp)
        assert state.keys() == expected.keys()
        for name, t in state.items():
            assert torch.equal(t, expected[name]), name
            assert t.untyped_storage().nbytes() == t.nbytes, name  # a copy of the slice, not a view of the whole


# -- where rank 0 listens ----------------------------------------------------------------------------

LISTENERS = """
import json, os, sys
import torch
from types import SimpleNamespace
from lazyrag.engine import tensor_parallel

def listening():  # (family, address) of every TCP socket this process listens on (Linux /proc)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    found = []
    for family in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{family}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:  # 0A: LISTEN
                found.append([family, f[1].split(":")[0]])
    return found

before = listening()
config = SimpleNamespace(tensor_parallel_size=1, tensor_parallel_timeout_s=30.0, device=torch.device("cpu"))
tp, workers = tensor_parallel.start(config, build=(print, (), {}))  # rank 0 of a group it starts itself
print(json.dumps([x for x in listening() if x not in before]))
"""
IPV4_LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
IPV4_ANY, IPV6_ANY = "00000000", "0" * 32


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from Linux's /proc")
def test_rank_0_listens_on_loopback_only_when_it_starts_the_workers(tmp_path):
    """``from_pretrained(tensor_parallel_size=N)`` spawns its workers on this host: rank 0's rendezvous store (and
    anything else the group opens) listens on loopback, never on every interface (torch's own ``tcp://`` store
    would)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    code, stdout, stderr = run_process([sys.executable, "-c", LISTENERS], env, tmp_path / "listeners.log")
    assert code == 0, stderr[-3000:]
    opened = json.loads(stdout.strip().splitlines()[-1])
    assert opened, "the group listens nowhere: this test no longer sees the store"
    assert not [a for family, a in opened if a in (IPV4_ANY, IPV6_ANY)], opened  # no wildcard address
    assert [family for family, a in opened if a == IPV4_LOOPBACK], opened  # the store, on 127.0.0.1


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is a loopback address of this host on Linux only")
def test_the_loopback_store_refuses_connections_to_any_other_address():
    import socket

    from lazyrag.engine.tensor_parallel import LOOPBACK, loopback_store

    store = loopback_store(2, 30.0)
    assert store.host == LOOPBACK == "127.0.0.1"
    socket.create_connection((LOOPBACK, store.port), timeout=10).close()
    with pytest.raises(ConnectionRefusedError):  # listening on every interface would take this one too
        socket.create_connection(("127.0.0.2", store.port), timeout=10).close()
    del store


# -- 2 gloo processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_give_one_process_logits_and_answers(tiny_folder, tmp_path):
    """full, lazy, position_aware and lazy+recover, in two chunk orders (the second reuses cached chunk KV at
    new positions), then a batch of three requests (greedy and seeded sampling): TP=2 matches TP=1."""
    one, two = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    run(tiny_folder, one, 1, "strategies")
    run(tiny_folder, two, 2, "strategies")
    strategies = assert_two_ranks_answer_as_one(torch.load(one), torch.load(two))
    assert strategies == {"full", "lazy", "position_aware", "lazy+recover"}


@pytest.mark.slow
def test_ranks_load_the_embedded_model_with_its_adapter_from_the_cache(tmp_path, monkeypatch):
    """An adapter is merged once, when the converted-model cache is filled; each rank then reads its shard of the
    merged weights: the same model, fingerprint and lazy logits as one process."""
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LAZYRAG_MODEL_CACHE", raising=False)
    one, two = tmp_path / "tp1.pt", tmp_path / "tp3.pt"
    run("embedded", one, 1, "tuned")  # converts and merges, then fills the cache
    run("embedded", two, 3, "tuned")  # the model's 3 KV heads split over 3 ranks
    a, b = torch.load(one), torch.load(two)
    assert (
        a["fingerprint"] == b["fingerprint"]
        and a["name"] == b["name"]
        and a["name"].endswith("+smollm2-135m-instruct-lazy")
    )
    torch.testing.assert_close(b["logits"], a["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_split_over_two_ranks_answer_as_one_process(family, tmp_path):
    """Qwen2's q/k/v biases sliced with their heads, Qwen3's q/k norms replicated: TP=2 matches TP=1."""
    from transformers import AutoTokenizer

    from lazyrag.model.loader import default_model_source

    folder = tmp_path / family
    tiny_family_model(family).save_pretrained(folder)
    src = default_model_source()
    AutoTokenizer.from_pretrained(src.folder, **src.kwargs()).save_pretrained(folder)
    one, two = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    run(folder, one, 1, "strategies")
    run(folder, two, 2, "strategies")
    assert_two_ranks_answer_as_one(torch.load(one), torch.load(two))


@pytest.mark.slow
def test_a_dead_worker_fails_the_request_clearly(tiny_folder, tmp_path):
    out = tmp_path / "kill.json"
    run(tiny_folder, out, 2, "kill")
    r = json.loads(out.read_text())
    assert r["first"]  # answered while both ranks lived
    assert r["error"].startswith("TensorParallelError") and "rank 1" in r["error"] and "SIGKILL" in r["error"]
    assert "tensor_parallel_size=2" in r["error"]  # says what to do
    # found at once (gloo sees the closed socket), not by timing out: the run's collectives have no timeout it could
    # reach (tp_run.py), so had it waited for one, the run would have hung and wait_working failed it
    assert "timed out" not in r["error"].lower(), r["error"]
    assert r["later"] is not None and r["later"].startswith("TensorParallelError")  # later requests fail at once
    assert r["worker_exit"] == -9
    assert r["healthy"] is None and "rank 1" in r["unhealthy"]  # what /health reports: 503 with this reason


@pytest.mark.slow
def test_idle_engine_keeps_its_workers_and_a_dead_driver_lets_them_go(tiny_folder, tmp_path):
    """Idle for 2.5x the collective timeout: the driver's pings keep the workers waiting, the next request is
    answered. Then rank 0 dies without a word: its worker exits by itself."""
    out = tmp_path / "idle.json"
    run(tiny_folder, out, 2, "idle")
    r = json.loads(out.read_text())
    assert r["again"] == r["first"]
    pid = r["worker_pid"]  # no longer this test's grandchild: rank 0 is gone
    wait_working(lambda: _exited(pid), lambda: tree_cpu_s(pid), "the worker, after rank 0 died")


@pytest.mark.slow
def test_torchrun_and_the_cli_flag_answer_as_one_process(tiny_folder, tmp_path):
    """``torchrun --nproc-per-node 2 -m lazyrag.cli ask`` (every rank started by torchrun) and
    ``lazyrag ask --tensor-parallel-size 2`` (rank 0 starts the other) print the one-process answer, once."""
    ask = [
        "-m",
        "lazyrag.cli",
        "ask",
        "Who discovered penicillin?",
        "--chunk",
        "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.",
        "--model",
        str(tiny_folder),
        "--device",
        "cpu",
        "--max-new-tokens",
        "6",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    answers = {}
    for name, cmd in (
        ("one", [sys.executable, *ask]),
        ("flag", [sys.executable, *ask, "--tensor-parallel-size", "2"]),
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *ask]),
    ):
        code, stdout, stderr = run_process(cmd, env, tmp_path / f"{name}.log")
        assert code == 0, (name, stderr[-3000:])
        assert stderr.count("chunks hit 0, missed 1") == 1, (name, stderr[-3000:])  # rank 0 alone reports
        answers[name] = stdout.strip()
    assert answers["one"] and answers["flag"] == answers["one"] and answers["torchrun"] == answers["one"]


@pytest.mark.slow
def test_the_tensor_parallel_benchmark_runs_small_on_cpu(tmp_path):
    """``benchmarks/tensor_parallel.py`` (the multi-GPU run's script) end to end on gloo: random weights made per
    rank by ``from_config``, a row per size with its timings and the weight-read floor of one rank's shard."""
    out = tmp_path / "tp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    code, stdout, stderr = run_process(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "tensor_parallel.py"),
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--sizes",
            "1,2",
            "--reps",
            "2",
            "--decode-tokens",
            "4",
            "--doc-tokens",
            "32",
            "--out",
            str(out),
        ],
        env,
        tmp_path / "benchmark.log",
    )
    assert code == 0, stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["tensor_parallel_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ttft_ms"] > 0 and r["decode_ms_per_token"] > 0 and len(r["ttft_all_ms"]) == 2
    # a rank of two holds half of each layer's projections: fewer bytes to read than the whole model
    assert rows[1]["weight_bytes_per_rank"] < rows[0]["weight_bytes_per_rank"]
    assert "TTFT vs first" in stdout
