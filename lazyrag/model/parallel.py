"""Tensor parallelism for the Llama forward: which slice of each weight a rank holds, and the all-reduce.

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (rank r keeps query heads
``[r Hq/N, (r+1) Hq/N)``, KV heads ``[r Hkv/N, (r+1) Hkv/N)`` and the same slice of the intermediate
size), o_proj and down_proj row-parallel (their input columns sliced the same way), each followed by
one explicit ``dist.all_reduce`` of its ``[T, H]`` output. Embeddings, norms and lm_head stay
replicated, so every rank ends a forward with the same hidden states and the same logits (an
all-reduce hands every rank the same sum). The all-reduce is explicit rather than DTensor's
``parallelize_module`` so the forward stays plain tensors: the Triton kernels, GEMVs and CUDA-graph
capture see the same code with smaller shapes, and TP=1 runs today's path untouched (``tp`` is None).

A rank's attention runs over its own heads only: its KV pool holds its KV heads of every block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed or stopped answering: the ranks can no longer run in step."""


@dataclass(eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel group, and the all-reduce the row-parallel layers call."""

    size: int
    rank: int
    group: ProcessGroup | None  # the device mesh's group (gloo on CPU, NCCL on CUDA) for the model's all-reduces
    cpu_group: ProcessGroup | None = None  # gloo group for the driver's commands (python objects); None: ``group``
    local_rank: int = 0
    # set by the engine's driver: a sentence naming which rank died (the message of the error requests get)
    describe_failure: Callable[[BaseException], str] | None = field(default=None, repr=False)
    failed: TensorParallelError | None = None  # once set, every collective raises it at once instead of waiting

    def __post_init__(self):
        if self.cpu_group is None:
            self.cpu_group = self.group

    def fail(self, cause: BaseException) -> TensorParallelError:
        """Mark the group broken (``cause``: what the collective raised) and return the error to raise."""
        if self.failed is None:
            msg = (
                self.describe_failure(cause)
                if self.describe_failure is not None
                else (
                    f"tensor-parallel rank {self.rank} of {self.size}: a collective failed ({cause}); another rank "
                    "died or stopped answering. Start the engine again (every rank)."
                )
            )
            self.failed = TensorParallelError(msg)
        return self.failed

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (a row-parallel layer's partial outputs); returns ``x``."""
        import torch.distributed as dist

        if self.failed is not None:  # a broken group: fail fast, never wait for a rank that is gone
            raise self.failed
        try:
            dist.all_reduce(x, group=self.group)
        except Exception as e:
            raise self.fail(e) from e
        return x

    def head_range(self, n: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of ``n`` heads (or intermediate columns)."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size


def check_divisible(args, size: int) -> None:
    """Refuse a split that would give ranks unequal heads (each rank's pool and kernels need whole KV heads)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1; got {size}")
    for what, n in (
        ("KV heads", args.num_kv_heads),
        ("query heads", args.num_heads),
        ("intermediate size", args.intermediate_size),
    ):
        if n % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the model's {n} {what}; each rank must hold an "
                f"equal share. Pick a size that divides {args.num_kv_heads} (the KV heads)."
            )


def local_args(args, size: int):
    """The ``LlamaArgs`` of one rank's shard: its query heads, KV heads and intermediate columns."""
    check_divisible(args, size)
    return replace(
        args,
        num_heads=args.num_heads // size,
        num_kv_heads=args.num_kv_heads // size,
        intermediate_size=args.intermediate_size // size,
    )


def shard_tensor(name: str, t: torch.Tensor, args, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of one tensor of a transformers Llama state dict (``args``: the full model's).
    Row-parallel biases are kept on rank 0 only (zeros elsewhere), so the all-reduce adds them once."""
    parts = name.split(".")
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    d = args.head_dim
    if proj in ("q_proj", "o_proj"):
        lo, hi = (r * d for r in tp.head_range(args.num_heads))
    elif proj in ("k_proj", "v_proj"):
        lo, hi = (r * d for r in tp.head_range(args.num_kv_heads))
    elif proj in ("gate_proj", "up_proj", "down_proj"):
        lo, hi = tp.head_range(args.intermediate_size)
    else:
        return t  # embeddings, norms, lm_head: replicated
    if proj not in ("o_proj", "down_proj"):  # column-parallel: output rows (and the bias) sliced
        return t[lo:hi].contiguous()
    if kind == "weight":  # row-parallel: input columns sliced
        return t[:, lo:hi].contiguous()
    return t if tp.rank == 0 else torch.zeros_like(t)


def shard_hf_state_dict(sd: dict[str, torch.Tensor], args, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slices of a whole transformers Llama state dict (names unchanged)."""
    return {name: shard_tensor(name, t, args, tp) for name, t in sd.items()}
