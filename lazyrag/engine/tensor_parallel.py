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
driver shipping each runner call). Every rank runs the whole engine core (engine/core.py) over its
shard: scheduler, planner and strategies, cache manager and tiers, unchanged. Rank 0, the driver,
alone takes requests; its engine's core is a ``TensorParallelCore`` whose every operation that
changes state under the engine's lock (``step``, ``drop_aborted``, ``encode``, ``attach``) is a
``call(name, *args)`` (nano-vllm's ``ModelRunner.call``): it broadcasts, in one ``broadcast_object_list``
on a gloo group, a ``Command``: the ``add`` and ``abort`` calls queued since the last one and the
operation's name and arguments; every rank makes those calls on its own ``EngineCore``
(``getattr(core, name)(*args)``), rank 0 too. Given that sequence the engine is deterministic (scheduling and
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
import dataclasses
import logging
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from lazyrag.engine.request import Request, SamplingParams
from lazyrag.model.parallel import TensorParallel, TensorParallelError

if TYPE_CHECKING:
    import torch.distributed as dist

    from lazyrag.engine.config import EngineConfig
    from lazyrag.engine.core import EngineCore, KVByKey
    from lazyrag.kv.identity import KVIdentity
    from lazyrag.prompt import PromptLayout
    from lazyrag.store.corpus import CorpusStore

log = logging.getLogger(__name__)

# what a spawned worker calls to make its engine: (function, args, kwargs), picklable
Build = tuple[Callable[..., object], tuple[Any, ...], dict[str, Any]]

# start-up waits (the rendezvous, then the barrier after every rank's load: minutes for a 70B-class model); the
# collectives after it are bounded by EngineConfig.tensor_parallel_timeout_s
START_TIMEOUT_S = 900.0
PARENT_ENV = "LAZYRAG_TP_PARENT"  # set in the workers from_pretrained spawns: they exit when their parent is gone


# -- start-up --------------------------------------------------------------------------------------


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


LOOPBACK = "127.0.0.1"  # where rank 0's store listens for the workers it spawns (always on this host)


def loopback_store(world_size: int, timeout_s: float) -> dist.TCPStore:
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


def start(config: EngineConfig, build: Build | None = None) -> tuple[TensorParallel, list[subprocess.Popen[bytes]]]:
    """Join the tensor-parallel group of ``config.tensor_parallel_size`` ranks: the launcher's (torchrun, or
    the worker processes this module spawns), or as rank 0 of a new one whose workers are spawned here.
    ``build`` = (function, args, kwargs), picklable: what each spawned worker calls to make its engine (the
    same call as rank 0's; it travels in the spec, so this module imports no engine). None: torchrun only."""
    size, timeout = config.tensor_parallel_size, config.tensor_parallel_timeout_s
    device = config.device
    assert isinstance(device, torch.device)  # EngineConfig.__post_init__ resolved it
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"tensor_parallel_size={size} but the launcher started {world} processes; pass "
                f"--nproc-per-node {size} or tensor_parallel_size={world}."
            )
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        return _join(size, rank, local, device.type, timeout, None), []
    if build is None:
        raise ValueError(
            "this engine cannot start its tensor-parallel workers itself: start every rank with "
            f"torchrun --nproc-per-node {size}."
        )
    store = loopback_store(size, max(START_TIMEOUT_S, timeout))
    fd, spec = tempfile.mkstemp(prefix="lazyrag-tp-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(build, f)
    workers: list[subprocess.Popen[bytes]] = []
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
        tp = _join(size, 0, 0, device.type, timeout, store, workers)
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
    store: dist.Store | None,
    workers: Sequence[subprocess.Popen[bytes]] = (),
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


def _rendezvous(workers: Sequence[subprocess.Popen[bytes]], **init: Any) -> None:
    import torch.distributed as dist

    _watching(workers, "joined", lambda: dist.init_process_group(**init))


def _watching(workers: Sequence[subprocess.Popen[bytes]], what: str, wait: Callable[[], None]) -> None:
    """Run ``wait`` (a start-up collective bounded by START_TIMEOUT_S); a worker this process spawned that
    exits meanwhile (a failed load) fails it at once instead of at the timeout."""
    if not workers:
        wait()
        return
    errors: list[BaseException] = []

    def run() -> None:
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


def abandon_start(workers: list[subprocess.Popen[bytes]]) -> None:
    """A start that failed after joining (a rank could not load its shard): kill the workers this process
    spawned and leave the group, so the caller's error is all that remains."""
    import torch.distributed as dist

    for w in workers:
        w.kill()
        w.wait()
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer is gone mid-collective: nothing left to tear down cleanly
            dist.destroy_process_group()


def attach(
    core: EngineCore, tp: TensorParallel, workers: list[subprocess.Popen[bytes]], timeout_s: float, lock: threading.Lock
) -> TensorParallelCore:
    """Rank 0: its core wrapped in a ``TensorParallelCore``, driving the others (``lock``: the engine's). Any other
    rank: serve rank 0 with ``core`` until it stops, then exit. First every rank waits for the others to have loaded
    their shards (a load takes minutes for a large model; the engine's collectives after it are bounded by
    ``timeout_s``)."""
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
        return TensorParallelCore(core, tp, workers, timeout_s, lock)
    sys.exit(serve(core, tp))


# -- what rank 0 sends: calls of a core's methods -------------------------------------------------

PING, STOP = "<ping>", "<stop>"  # no core method: rank 0's keep-alive, and the end of the workers' loop


@dataclass
class NewRequest:
    """A request on its first trip to the other ranks (with ``add``): what each needs to make its own copy."""

    id: int  # ``Request.tp_id``: the id every rank knows it by
    layout: PromptLayout
    params: SamplingParams
    arrival: float
    prompt_logits_only: bool

    @classmethod
    def of(cls, req: Request) -> NewRequest:
        return cls(req.tp_id, req.layout, req.params, req.arrival, req.prompt_logits_only)

    def request(self) -> Request:
        return Request(self.layout, self.params, arrival=self.arrival, prompt_logits_only=self.prompt_logits_only)


@dataclass
class SentRequest:
    """A request every rank was sent already, by its id."""

    id: int


@dataclass
class Queued:
    """A call made from any thread (``add``, ``abort``) that travels with the next broadcast."""

    name: str
    req: Request  # rank 0's
    sent: NewRequest | SentRequest  # what stands for it on the wire


@dataclass
class Command:
    """One broadcast. The ids of requests that ended (``ended``) or were aborted (``aborted``) on rank 0 alone
    since the last one (a consumer gone, a detokenizer or notify fault); the calls queued meanwhile, in order; then
    the operation, ``name(*args)``, a method of the core (or PING, STOP)."""

    ended: list[int]
    aborted: list[int]
    queued: list[tuple[str, NewRequest | SentRequest]]
    name: str
    args: tuple[Any, ...]


class TensorParallelCore:
    """Rank 0's core: the same methods as its ``EngineCore``, which run there and on every other rank's, in the same
    order. ``add`` and ``abort`` (any thread) are queued and travel with the next operation; each operation that
    changes state (``step``, ``drop_aborted``, ``encode``, ``attach``, ``forget``) is ``call``ed: its name and
    arguments broadcast, then run here. Reads (keys, the identity, the clock) are rank 0's own."""

    supports_warm_up = False  # LazyEngine.warm_up does nothing here: the first request pays the first-call costs

    def __init__(
        self,
        core: EngineCore,
        tp: TensorParallel,
        workers: list[subprocess.Popen[bytes]],
        timeout_s: float,
        lock: threading.Lock,
    ):
        self.core, self.tp, self.workers, self.lock = core, tp, workers, lock
        self.scheduler, self.planner, self.cache, self.runner = core.scheduler, core.planner, core.cache, core.runner
        self.attention_backend = core.attention_backend
        self.interval = timeout_s / 4
        self._pending: list[Queued] = []  # from any thread
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

    def seeded(self, params: SamplingParams) -> SamplingParams:
        if params.seed is None and params.temperature > 0:
            # every rank samples the same token only from the same generator: a seed for each rank to use
            return dataclasses.replace(params, seed=random.getrandbits(63))
        return params

    def add(self, req: Request) -> None:
        """Taken in by every rank at the next operation."""
        if self.tp.failed is not None:
            raise self.tp.failed
        with self._pending_lock:
            req.tp_id, self._next_id = self._next_id, self._next_id + 1
            self._pending.append(Queued("add", req, NewRequest.of(req)))

    def abort(self, req: Request) -> None:
        """Every rank marks it at the same point of its work: the next operation."""
        with self._pending_lock:
            self._pending.append(Queued("abort", req, SentRequest(req.tp_id)))

    def has_work(self) -> bool:
        return self.core.has_work() or bool(self._pending)

    def now(self) -> float:
        return self.core.now()

    def attached(self, folder: Path) -> CorpusStore | None:
        return self.core.attached(folder)

    def chunk_key(self, prefix_ids: list[int], chunk_ids: list[int]) -> str:
        return self.core.chunk_key(prefix_ids, chunk_ids)

    def prefix_key(self, prefix_ids: list[int]) -> str:
        return self.core.prefix_key(prefix_ids)

    def identity(self, model_name: str, system: str, prefix_ids: list[int], encoding_passage: str) -> KVIdentity:
        return self.core.identity(model_name, system, prefix_ids, encoding_passage)

    def attach(self, store: CorpusStore | Path, identity: KVIdentity) -> CorpusStore:
        """Every rank opens the folder and attaches it at the same point of its work (under the engine's lock, which
        one process does not need for it)."""
        from lazyrag.store.corpus import CorpusStore

        folder = store.path.expanduser().resolve() if isinstance(store, CorpusStore) else store
        with self.lock:
            attached: CorpusStore = self.call("attach", folder, identity)
            return attached

    # the engine's lock held

    def step(self) -> bool:
        try:
            stepped: bool = self.call("step")
            return stepped
        except Exception:  # the group broke: every request was failed with its error, nothing left to run
            return False

    def drop_aborted(self) -> None:
        with contextlib.suppress(Exception):  # the group broke: its requests were failed already
            self.call("drop_aborted")

    def encode(self, prefix_ids: list[int], chunks: list[list[int]], read: bool) -> tuple[int, KVByKey]:
        if read:
            raise ValueError(
                "A tensor-parallel engine's ranks each hold their share of the KV heads, so it cannot read "
                "whole chunk KV (e.g. to build a store): build the store with tensor_parallel_size=1; a "
                "tensor-parallel engine reads it, each rank its own heads."
            )
        encoded: tuple[int, KVByKey] = self.call("encode", prefix_ids, chunks, False)
        return encoded

    def forget(self) -> None:
        self.call("forget")

    def call(self, name: str, *args: Any) -> Any:
        """Send what was queued and ``name(*args)`` to every rank, apply the queued calls here too, and run
        ``name`` on this rank's core; its result."""
        if self.tp.failed is not None:
            self._fail_all([])
            raise self.tp.failed
        with self._pending_lock:
            queued, self._pending = self._pending, []
        ended = [i for i, r in self._live.items() if r.stage.ended]
        for i in ended:
            del self._live[i]
        aborted = [i for i, r in self._live.items() if r.aborted]
        command = Command(ended, aborted, [(q.name, q.sent) for q in queued], name, args)
        try:
            torch.distributed.broadcast_object_list([command], src=0, group=self.tp.cpu_group)
        except Exception as e:
            error = self.tp.fail(e)
            self._fail_all([q.req for q in queued if isinstance(q.sent, NewRequest)])
            raise error from e
        self._last_sync = time.monotonic()
        for q in queued:
            if isinstance(q.sent, NewRequest):
                self._live[q.req.tp_id] = q.req
            getattr(self.core, q.name)(q.req)
        out = None if name in (PING, STOP) else getattr(self.core, name)(*args)
        if self.tp.failed is not None:  # a collective failed inside the operation: nothing can run any more
            self._fail_all([])
        return out

    def _fail_all(self, extra: list[Request]) -> None:
        """Fail every request in flight with the group's error, and stop the workers still alive."""
        error = self.tp.failed
        assert error is not None
        with self._pending_lock:
            extra = extra + [q.req for q in self._pending if isinstance(q.sent, NewRequest)]
            self._pending = []
        self.core.scheduler.fail_all(error, list(self._live.values()) + extra)
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
        dead: list[tuple[int, subprocess.Popen[bytes]]] = []
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
            with self.lock:
                if (
                    self._closed.is_set()
                    or self.tp.failed is not None
                    or time.monotonic() - self._last_sync < self.interval
                ):
                    continue
                try:
                    self.call(PING)
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
                with self.lock:
                    self.call(STOP)
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


def serve(core: EngineCore, tp: TensorParallel) -> int:
    """Make rank 0's calls on this rank's core until it says stop (0) or is lost (1)."""
    if os.environ.get(PARENT_ENV):
        threading.Thread(target=_watch_parent, args=(int(os.environ[PARENT_ENV]),), daemon=True).start()
        # a terminal's Ctrl-C reaches the whole process group: rank 0 stops this worker (or its exit does)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests: dict[int, Request] = {}  # by the id rank 0 sent them with
    while True:
        box: list[Any] = [None]
        try:
            torch.distributed.broadcast_object_list(box, src=0, group=tp.cpu_group)
        except Exception as e:
            log.error("lazyrag tensor-parallel rank %d: lost rank 0 (%s); exiting", tp.rank, e)
            return 1
        command: Command = box[0]
        _take_in(core, command, requests)
        if command.name == STOP:
            return 0
        try:
            if command.name != PING:
                getattr(core, command.name)(*command.args)
        except Exception:  # rank 0 ran the same operation and raised the same to its caller
            log.debug("lazyrag tensor-parallel rank %d: %s failed", tp.rank, command.name, exc_info=True)
        if tp.failed is not None:
            log.error("lazyrag tensor-parallel rank %d: %s; exiting", tp.rank, tp.failed)
            return 1


def _take_in(core: EngineCore, command: Command, requests: dict[int, Request]) -> None:
    """What rank 0 did to requests since the last command, in its order: ended, aborted, then the queued calls."""
    for i in command.ended:  # ended on rank 0 (finished, failed or aborted there): end it here too, now
        req = requests.pop(i, None)
        if req is not None:
            core.drop(req)
    for i in command.aborted:
        if i in requests:
            core.abort(requests[i])
    for name, sent in command.queued:
        if isinstance(sent, NewRequest):
            requests[sent.id] = sent.request()
        if sent.id in requests:  # else it ended here already: nothing left to do to it
            getattr(core, name)(requests[sent.id])


def main(argv: list[str]) -> int:
    """A worker that ``start`` spawned: load the engine its spec describes (which serves, then exits)."""
    with open(argv[0], "rb") as f:
        build, args, kwargs = pickle.load(f)
    build(*args, **kwargs)  # on a rank > 0 this serves rank 0, then exits the process
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
