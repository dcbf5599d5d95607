"""The workload of tests/distributed/test_tensor_parallel.py, run in its own process (so a hang is killed by the
test's stall guard, and a process group never outlives its test): ``python tp_run.py MODEL OUT TP MODE``.

MODE ``strategies``: each strategy's logits after a prompt and its greedy answer (``steps``: each token with
the two likeliest tokens' logprobs, so the test can tell a near-tie that another sum order may break the other
way), then a batch of requests at once; saved with torch.save to OUT. MODE ``kill``: with TP > 1, answer once,
SIGKILL worker rank 1, answer again; OUT gets the error, how long it took, and whether the worker is gone. MODE
``idle``: a short collective timeout, idle for longer than it, then answer (the driver's pings keep the workers
waiting); then write the worker's pid and die without a word (the worker must exit by itself). MODE ``tuned``:
MODEL ``embedded`` with the shipped adapter, from the converted-model cache: lazy's logits and the fingerprint.
"""

import json
import os
import signal
import sys
import time

import torch

CHUNKS = [
    "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.",
    "Tea reached Britain in 1662, when Catherine of Braganza married Charles the Second.",
    "The Eiffel Tower was finished in 1889 for the world's fair held in Paris that year.",
]
QUESTION = "Who discovered penicillin, and when did tea reach Britain?"
STRATEGIES = ["full", "lazy", "position_aware", "lazy+recover"]
# The collective timeout of the runs that do not test it: a day, which no run reaches. It stood at 20 s, then 120 s:
# a bound a busy machine's rank, waiting its turn for a core, could reach (issue 44). A hang is the test's to find
# (its wait_working: no CPU time in any rank), and a dead rank is found at once (gloo sees the closed socket).
NO_TIMEOUT_S = 24 * 3600.0


def steps(result) -> list[tuple[int, list[tuple[int, float]]]]:
    """A greedy answer's tokens, each with the two likeliest tokens and their logprobs (``logprobs=2``)."""
    return [(lp.token_id, lp.top) for lp in result.logprobs]


def main(model: str, out: str, tp: int, mode: str) -> None:
    from lazyrag.engine import LazyEngine, SamplingParams

    timeout = 3.0 if mode == "idle" else NO_TIMEOUT_S  # idle tests the collective timeout itself
    # the embedded model's KV takes 8x the tiny models' a token
    which = (
        dict(model=None, adapter="embedded", kv_budget=64 << 20)
        if mode == "tuned"
        else dict(model=model, kv_budget=8 << 20)
    )
    engine = LazyEngine.from_pretrained(
        **which, device="cpu", tensor_parallel_size=tp, tensor_parallel_timeout_s=timeout
    )
    if mode == "tuned":
        logits = engine.next_token_logits(QUESTION, CHUNKS, strategy="lazy")
        torch.save({"logits": logits, "fingerprint": engine.fingerprint, "name": engine.model_name}, out)
    elif mode == "strategies":
        res = {}
        for order in (CHUNKS, CHUNKS[::-1]):  # the second order reuses the chunks' KV at new positions
            for s in STRATEGIES:
                res[f"{s}/{order[0][:8]}/logits"] = engine.next_token_logits(QUESTION, order, strategy=s)
                r = engine.generate(QUESTION, order, max_new_tokens=8, strategy=s, ignore_eos=True, logprobs=2)
                res[f"{s}/{order[0][:8]}/steps"] = steps(r)
        # several requests batched in one step, one of them sampled (seeded by the driver under TP: same on every rank)
        reqs = [
            engine.add_request(
                engine.build_prompt(q, CHUNKS[i:] + CHUNKS[:i]),
                SamplingParams(
                    max_new_tokens=6,
                    ignore_eos=True,
                    strategy=s,
                    temperature=0.0 if i < 2 else 0.8,
                    seed=7 if i == 2 else None,
                    logprobs=2 if i < 2 else None,
                ),
            )
            for i, (q, s) in enumerate(
                [
                    ("When was the tower built?", "lazy"),
                    ("Who married Charles?", "lazy+recover"),
                    ("Where is St Mary's?", "lazy"),
                ]
            )
        ]
        while engine.has_unfinished_requests():
            engine.step()
        res["batch/greedy"] = [steps(r.result()) for r in reqs[:2]]
        res["batch/sampled"] = reqs[2].result().text
        res["fingerprint"] = engine.fingerprint  # the whole model's at any size: stores and caches match
        torch.save(res, out)
    elif mode == "idle":
        first = engine.generate(QUESTION, CHUNKS, max_new_tokens=4, ignore_eos=True).text
        time.sleep(2.5 * timeout)
        again = engine.generate(QUESTION, CHUNKS, max_new_tokens=4, ignore_eos=True).text
        with open(out, "w") as f:
            json.dump({"first": first, "again": again, "worker_pid": engine.core.workers[0].pid}, f)
        os._exit(0)  # then no close, no atexit: as if rank 0 crashed (its worker must exit by itself)
    else:
        first = engine.generate(QUESTION, CHUNKS, max_new_tokens=4, ignore_eos=True).text
        worker = engine.core.workers[0]
        healthy = engine.health_problem()
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        unhealthy = engine.health_problem()  # before any request finds out
        t0 = time.monotonic()
        try:
            engine.generate(QUESTION, CHUNKS[::-1], max_new_tokens=4, ignore_eos=True)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        try:
            engine.generate("Another question?", CHUNKS, max_new_tokens=2)
            later = None
        except Exception as e:
            later = f"{type(e).__name__}: {e}"
        with open(out, "w") as f:
            json.dump(
                {
                    "first": first,
                    "error": error,
                    "took_s": took,
                    "later": later,
                    "worker_exit": worker.poll(),
                    "healthy": healthy,
                    "unhealthy": unhealthy,
                },
                f,
            )
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
