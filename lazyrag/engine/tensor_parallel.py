"""Tensor parallelism across processes on torch.distributed: how the ranks start, and how they stay in step.

Start-up. ``torchrun --nproc-per-node N -m lazyrag.cli ...`` starts N processes with RANK / WORLD_SIZE
set; ``LazyEngine.from_pretrained(..., tensor_parallel_size=N)`` in a plain process starts the N - 1
workers itself (``python -m lazyrag.engine.tensor_parallel SPEC``) and is rank 0: its rendezvous store
(a TCPStore) listens on loopback only, 127.0.0.1 on a free port (``loopback_store``; torch's own
``tcp://`` store would listen on every interface), and the workers, processes of the same host, reach it
there. Under torchrun, the launcher's rendezvous (``--master-addr``, ``--rdzv-endpoint``) is used as
given. Either way every rank calls ``init_process_group`` (gloo on CPU, NCCL on CUDA),
makes a 1-D ``DeviceMesh`` over a group whose collectives are bounded by ``tensor_parallel_timeout_s``,
then reads only its shard of the checkpoint (``loader.load_sharded``: one tensor at a time from
safetensors), and waits at a barrier for the slowest load (start-up waits are bounded by START_TIMEOUT_S;
rank 0 fails at once if a worker it spawned exits). Rank 0 returns the engine; on the other ranks
``from_pretrained`` never returns: they serve rank 0 until it stops, then exit.

Keeping the ranks in step (SGLang's design: every TP rank runs the scheduler, rather than vLLM's
driver shipping each runner call). Every rank runs the whole engine over its shard: scheduler,
planner and strategies, cache manager and tiers, unchanged. Rank 0, the driver, alone takes
requests; at every point where the engine changes state under its lock (a step, dropping aborted
requests, encoding chunks ahead, attaching a store) it broadcasts, in one ``broadcast_object_list``
on a gloo group, the requests added and aborted since the last one and the operation, and every rank
applies them and runs the operation. Given that sequence the engine is deterministic (scheduling and
eviction read no clocks; the driver seeds every sampled request that has no seed), and every rank
gets the same logits (all-reduced hidden states, replicated lm_head), so every rank plans, allocates,
evicts and samples alike and its forwards meet the others' all-reduce for all-reduce. Why not ship
runner calls: the strategies touch the pool and the model in many places (re-rotated copies,
CacheBlend's own per-layer attention, tier loads); mirroring the engine keeps them unchanged, for one
small broadcast a step. What only the driver sees (a consumer that went away, a detokenizer or notify
fault) is synced: each broadcast carries the ids of the driver's requests that ended or were aborted,
and a rank still running one ends it first.

Faults: every collective is bounded by ``tensor_parallel_timeout_s``; an idle driver pings the workers
every quarter of it, so a worker waiting for a command never times out while rank 0 lives, and a dead
worker is found within it. A rank that dies (or a collective that fails) breaks the group: every
request in flight fails with a ``TensorParallelError`` naming the dead rank and what to do, later
requests fail at once, the driver stops the other workers, and a worker that loses rank 0 exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from lazyrag.engine.request import Request
from lazyrag.model.parallel import TensorParallel, TensorParallelError

log = logging.getLogger(__name__)

# start-up waits (the rendezvous, then the barrier after every rank's load: minutes for a 70B-class model); the
# collectives after it are bounded by EngineConfig.tensor_parallel_timeout_s
START_TIMEOUT_S = 900.0
PARENT_ENV = "LAZYRAG_TP_PARENT"  # set in the workers from_pretrained spawns: they exit when their parent is gone


# -- start-up --------------------------------------------------------------------------------------


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


LOOPBACK = "127.0.0.1"  # where rank 0's store listens for the workers it spawns (always on this host)


def loopback_store(world_size: int, timeout_s: float):
    """Rank 0's rendezvous store for the workers this process spawns: a TCPStore on a free port of loopback,
    listening there only (a TCPStore given a host still listens on every interface: here it is handed a
    socket bound to 127.0.0.1, which also leaves no window for another process to take the port)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(max(128, world_size))
        store = dist.TCPStore(
            LOOPBACK,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now (and closes it)
    return store


def start(config, build=None) -> tuple[TensorParallel, list[subprocess.Popen]]:
    """Join the tensor-parallel group of ``config.tensor_parallel_size`` ranks: the launcher's (torchrun, or
    the worker processes this module spawns), or as rank 0 of a new one whose workers are spawned here.
    ``build`` = (function, args, kwargs), picklable: what each spawned worker calls to make its engine (the
    same call as rank 0's; it travels in the spec, so this module imports no engine). None: torchrun only."""
    size, timeout = config.tensor_parallel_size, config.tensor_parallel_timeout_s
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size={size} but the launcher started {world} processes; pass "
                f"--nproc-per-node {size} or tensor_parallel_size={world}."
            )
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        return _join(size, rank, local, config.device.type, timeout, None), []
    if build is None:
        raise ValueError(
            "this engine cannot start its tensor-parallel workers itself: start every rank with "
            f"torchrun --nproc-per-node {size}."
        )
    store = loopback_store(size, max(START_TIMEOUT_S, timeout))
    fd, spec = tempfile.mkstemp(prefix="lazyrag-tp-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(build, f)
    workers = []
    try:
        for rank in range(1, size):
            env = dict(
                os.environ,
                MASTER_ADDR=LOOPBACK,
                MASTER_PORT=str(store.port),
                RANK=str(rank),
                WORLD_SIZE=str(size),
                LOCAL_RANK=str(rank),
                **{PARENT_ENV: str(os.getpid())},
            )
            workers.append(subprocess.Popen([sys.executable, "-m", "lazyrag.engine.tensor_parallel", spec], env=env))
        tp = _join(size, 0, 0, config.device.type, timeout, store, workers)
    except BaseException as e:
        abandon_start(workers)
        dead = [f"rank {i + 1} exited with code {w.returncode}" for i, w in enumerate(workers)]
        raise TensorParallelError(
            f"could not start the {size} tensor-parallel ranks ({e}); workers: {', '.join(dead)}"
        ) from e
    finally:
        # the workers read the spec before they join, so it can go once every rank has joined (or failed)
        os.unlink(spec)
    return tp, workers


def _join(
    size: int,
    rank: int,
    local_rank: int,
    device_type: str,
    timeout_s: float,
    store,
    workers: Sequence[subprocess.Popen] = (),
) -> TensorParallel:
    """``store``: rank 0's ``loopback_store`` when it spawned the workers; None: the launcher's (``env://``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # a store given to init_process_group is used as it is, one it makes (env://, as the workers join) under the
        # prefix "default_pg": rank 0 puts its own under that prefix too, so every rank's keys meet
        given = {} if store is None else {"store": dist.PrefixStore("default_pg", store)}
        _rendezvous(
            workers,
            backend=backend,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=max(START_TIMEOUT_S, timeout_s)),
            **given,
        )
    # the group every collective runs on, bounded by the engine's timeout (the default group's is the start-up's)
    group = dist.new_group(backend=backend, timeout=timeout)
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    # commands are python objects: on NCCL they go over a gloo group of their own (no device copies)
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(size, dist.get_rank(), mesh.get_group("tp"), cpu_group, local_rank)


def _rendezvous(workers: Sequence[subprocess.Popen], **init) -> None:
    import torch.distributed as dist

    _watching(workers, "joined", lambda: dist.init_process_group(**init))


def _watching(workers: Sequence[subprocess.Popen], what: str, wait: Callable[[], None]) -> None:
    """Run ``wait`` (a start-up collective bounded by START_TIMEOUT_S); a worker this process spawned that
    exits meanwhile (a failed load) fails it at once instead of at the timeout."""
    if not workers:
        wait()
        return
    errors: list[BaseException] = []

    def run():
        try:
            wait()
        except BaseException as e:
            errors.append(e)

    waiting = threading.Thread(target=run, name="lazyrag-tp-start", daemon=True)
    waiting.start()
    while waiting.is_alive():
        waiting.join(0.2)
        if waiting.is_alive() and any(w.poll() is not None for w in workers):
            raise TensorParallelError(f"a worker exited before every rank had {what}")
    if errors:
        raise errors[0]


def abandon_start(workers: list[subprocess.Popen]) -> None:
    """A start that failed after joining (a rank could not load its shard): kill the workers this process
    spawned and leave the group, so the caller's error is all that remains."""
    import torch.distributed as dist

    for w in workers:
        w.kill()
        w.wait()
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer is gone mid-collective: nothing left to tear down cleanly
            dist.destroy_process_group()


def attach(engine, tp: TensorParallel, workers: list[subprocess.Popen]):
    """Rank 0: the engine, driving the others. Any other rank: serve rank 0 until it stops, then exit.
    First every rank waits for the others to have loaded their shards (a load takes minutes for a large model;
    the engine's collectives after it are bounded by its own timeout)."""
    import torch.distributed as dist

    try:
        _watching(workers, "loaded its shard", dist.barrier)  # the default group: START_TIMEOUT_S
    except BaseException as e:
        abandon_start(workers)
        raise TensorParallelError(
            f"tensor-parallel rank {tp.rank}: not every rank loaded its shard ({e}); see the "
            "other ranks' output for why (a missing file, out of memory?)"
        ) from e
    if tp.rank == 0:
        engine.tp_driver = Driver(engine, tp, workers, engine.config.tensor_parallel_timeout_s)
        return engine
    sys.exit(serve(engine, tp))


# -- the operations every rank runs, in the same order -------------------------------------------


def run_op(engine, op: str, args: tuple):
    if op == "step":
        return engine.scheduler.step()
    if op == "drop_aborted":
        return engine.scheduler.drop_aborted()
    if op == "encode":
        return engine._encode_locked(*args)
    if op == "attach":
        return engine._attach_store_locked(*args)
    if op in ("noop", "stop"):
        return None
    raise ValueError(f"unknown tensor-parallel operation {op!r}")


class Driver:
    """Rank 0's side: queue what callers add and abort, and broadcast it with each operation."""

    def __init__(self, engine, tp: TensorParallel, workers: list[subprocess.Popen], timeout_s: float):
        self.engine, self.tp, self.workers = engine, tp, workers
        self.interval = timeout_s / 4
        self._pending: list[tuple[str, Request]] = []  # ("add" | "abort", request), from any thread
        self._pending_lock = threading.Lock()
        self._live: dict[int, Request] = {}  # requests every rank holds, by the id they were sent with
        self._next_id = 0
        self._last_sync = time.monotonic()
        self._closed = threading.Event()
        tp.describe_failure = self.describe_failure
        self._pinger = threading.Thread(target=self._ping, name="lazyrag-tp-ping", daemon=True)
        self._pinger.start()
        atexit.register(self.close)

    # any thread

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, req: Request) -> None:
        if self.tp.failed is not None:
            raise self.tp.failed
        with self._pending_lock:
            req.tp_id, self._next_id = self._next_id, self._next_id + 1
            self._pending.append(("add", req))

    def abort(self, req: Request) -> None:
        with self._pending_lock:
            self._pending.append(("abort", req))

    # the engine's lock held

    def sync(self, op: str, *args):
        """Send what was queued and ``op`` to every rank, apply it here too, and run ``op``; its result."""
        if self.tp.failed is not None:
            self._fail_all([])
            raise self.tp.failed
        with self._pending_lock:
            queued, self._pending = self._pending, []
        ended = [i for i, r in self._live.items() if r.done]
        for i in ended:
            del self._live[i]
        aborted = [i for i, r in self._live.items() if r.aborted]
        wire = [
            ("add", r.tp_id, r.layout, r.params, r.arrival, r.prompt_logits_only)
            if kind == "add"
            else ("abort", r.tp_id)
            for kind, r in queued
        ]
        try:
            torch.distributed.broadcast_object_list([(wire, ended, aborted, op, args)], src=0, group=self.tp.cpu_group)
        except Exception as e:
            error = self.tp.fail(e)
            self._fail_all([r for kind, r in queued if kind == "add"])
            raise error from e
        self._last_sync = time.monotonic()
        for kind, r in queued:
            if kind == "add":
                self._live[r.tp_id] = r
                self.engine.scheduler.add(r)
            else:
                self.engine.scheduler.abort(r)
        out = run_op(self.engine, op, args)
        if self.tp.failed is not None:  # a collective failed inside the operation: nothing can run any more
            self._fail_all([])
        return out

    def _fail_all(self, extra: list[Request]) -> None:
        """Fail every request in flight with the group's error, and stop the workers still alive."""
        s, error = self.engine.scheduler, self.tp.failed
        with self._pending_lock:
            extra = extra + [r for kind, r in self._pending if kind == "add"]
            self._pending = []
        for req in list(s.inbox) + list(s.waiting) + list(s.running) + list(self._live.values()) + extra:
            s._fail(req, error)
        s.inbox.clear()
        s.waiting.clear()
        s._launched = None
        self._live.clear()
        self._stop_workers(wait=0.0)

    def problem(self) -> str | None:
        """Why the ranks can no longer serve (the group failed, or a worker this process started has exited), or
        None: what a health check reports (cheap, no collective)."""
        if self.tp.failed is not None:
            return str(self.tp.failed)
        dead = [(i + 1, w) for i, w in enumerate(self.workers) if w.poll() is not None]
        if dead:
            return "tensor-parallel " + ", ".join(
                f"rank {r} (pid {w.pid}) exited with code {w.returncode}" for r, w in dead
            )
        return None

    def describe_failure(self, cause: BaseException) -> str:
        deadline = time.monotonic() + 2.0  # a killed worker is reaped a moment after its sockets close
        dead: list[tuple[int, subprocess.Popen]] = []
        while not dead and time.monotonic() < deadline:
            dead = [(i + 1, w) for i, w in enumerate(self.workers) if w.poll() is not None]
            if not dead:
                time.sleep(0.05)
        if dead:
            who = ", ".join(
                f"rank {r} (pid {w.pid}) exited with code {w.returncode}"
                + (f" ({signal.Signals(-w.returncode).name})" if w.returncode < 0 else "")
                for r, w in dead
            )
        else:
            who = "a rank stopped answering"
        return (
            f"tensor-parallel engine of {self.tp.size} ranks: {who}; the ranks can no longer run in step, so the "
            f"request failed ({type(cause).__name__}: {str(cause)[:200]}). Every later request fails too: create "
            f"the engine again (LazyEngine.from_pretrained(..., tensor_parallel_size={self.tp.size})), or rerun "
            "torchrun, after finding why the rank died (its log; out of memory?)."
        )

    def _ping(self) -> None:
        """Keep the workers' bounded wait for the next command from timing out while rank 0 is idle."""
        while not self._closed.wait(min(1.0, self.interval / 2)):
            if time.monotonic() - self._last_sync < self.interval or self.tp.failed is not None:
                continue
            with self.engine._lock:
                if (
                    self._closed.is_set()
                    or self.tp.failed is not None
                    or time.monotonic() - self._last_sync < self.interval
                ):
                    continue
                try:
                    self.sync("noop")
                except Exception:
                    log.error("lazyrag: %s", self.tp.failed)

    def _stop_workers(self, wait: float) -> None:
        for w in self.workers:
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.wait(timeout=wait)
            if w.poll() is None:
                w.kill()
                w.wait()

    def close(self) -> None:
        """Stop the workers (they exit) and leave the process group. Idempotent; also at exit."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.tp.failed is None:
            try:
                with self.engine._lock:
                    self.sync("stop")
            except Exception:
                pass
        self._stop_workers(wait=10.0)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# -- a worker rank --------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # the process that spawned us is gone: nothing will send another command
            os._exit(3)
        time.sleep(0.5)


def serve(engine, tp: TensorParallel) -> int:
    """Apply rank 0's commands to this rank's engine until it says stop (0) or is lost (1)."""
    if os.environ.get(PARENT_ENV):
        threading.Thread(target=_watch_parent, args=(int(os.environ[PARENT_ENV]),), daemon=True).start()
        # a terminal's Ctrl-C reaches the whole process group: rank 0 stops this worker (or its exit does)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    s = engine.scheduler
    requests: dict[int, Request] = {}
    while True:
        box: list[Any] = [None]
        try:
            torch.distributed.broadcast_object_list(box, src=0, group=tp.cpu_group)
        except Exception as e:
            log.error("lazyrag tensor-parallel rank %d: lost rank 0 (%s); exiting", tp.rank, e)
            return 1
        wire, ended, aborted, op, args = box[0]
        for i in ended:  # ended on rank 0 (finished, failed or aborted there): end it here too, now
            req = requests.pop(i, None)
            if req is not None and not req.done:
                s.drop(req)
        for i in aborted:
            if i in requests:
                s.abort(requests[i])
        for cmd in wire:
            if cmd[0] == "add":
                _, i, layout, params, arrival, logits_only = cmd
                requests[i] = s.add(Request(layout, params, arrival=arrival, prompt_logits_only=logits_only))
            elif cmd[1] in requests:
                s.abort(requests[cmd[1]])
        if op == "stop":
            return 0
        try:
            run_op(engine, op, args)
        except Exception:  # rank 0 ran the same operation and raised the same to its caller
            log.debug("lazyrag tensor-parallel rank %d: %s failed", tp.rank, op, exc_info=True)
        if tp.failed is not None:
            log.error("lazyrag tensor-parallel rank %d: %s; exiting", tp.rank, tp.failed)
            return 1


def main(argv: list[str]) -> int:
    """A worker that ``start`` spawned: load the engine its spec describes (which serves, then exits)."""
    with open(argv[0], "rb") as f:
        build, args, kwargs = pickle.load(f)
    build(*args, **kwargs)  # on a rank > 0 this serves rank 0, then exits the process
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
