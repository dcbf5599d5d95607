"""``lazyrag tune``: teach a model to answer over chunks encoded on their own (``lazy``) as it answers over a
full prefill, by distillation to its own full-prefill answers (no labels needed).

Each step draws prompts from the sets' tune parts (tune/data.py), takes the base model's greedy full-prefill
answer to each (computed once, by the engine, before training) and minimises

    KL(base full || tuned lazy) + full_weight * KL(base full || tuned full)

over the answer tokens: the first term makes ``lazy`` read like a full prefill, the second keeps the tuned
model's own full prefill (and chat without documents) where the base model's was. The lazy forward computes
what the engine computes (tune/forward.py), so what is learnt is what the engine will run.

A LoRA adapter (peft) by default, or every weight (``method="full"``, for small models). Progress bar,
checkpoints every ``save_every`` steps, resume after a kill (the same command again), a seed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lazyrag.eval import DATASETS
from lazyrag.prompt import DEFAULT_ENCODING_PASSAGE, DEFAULT_SYSTEM_PROMPT, PromptBuilder, passage_label, passage_sha256
from lazyrag.tune.adapter import TUNE_FILE, base_id
from lazyrag.tune.data import PromptSampler, is_dev, load_questions
from lazyrag.tune.forward import Example, activation_checkpointing, full_logits, lazy_logits

log = logging.getLogger(__name__)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TEACHER_FILE = "teacher_answers.jsonl"
TEACHER_BLOCK = 25  # steps whose teacher answers are generated together
TEACHER_KV_BYTES = 2 << 30  # the teacher engine's KV pool: room for a block's prompts beside training
CHECKPOINT = "checkpoint"
# fields that may change between a run and its resume (the rest must match, or the resume is refused)
RESUMABLE = {
    "max_steps",
    "progress",
    "eval_every",
    "save_every",
    "out",
    "device",
    "time_limit",
    "activation_checkpointing",
}


@dataclass
class TuneConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; or a local Llama folder / .gguf file
    out: str = "lazyrag-tuned"  # the adapter folder (or, method="full", a model folder)
    method: str = "lora"  # lora | full
    lora_rank: int = 8
    lora_alpha: int = 16
    learning_rate: float | None = None  # None: 2e-4 for LoRA, 2e-5 for full fine-tuning
    max_steps: int = 1000
    prompts_per_step: int = 8
    passages: tuple[int, ...] = (5, 10, 20)  # passages per training prompt (the question's own, then distractors)
    sets: tuple[str, ...] = DATASETS
    data: dict[str, str] = field(default_factory=dict)  # dataset -> its file, where not the default
    answer_tokens: int = 32  # teacher answers are cut here
    full_weight: float = 0.25
    warmup_steps: int = 20
    dev_prompts: int = 32  # held-out tune prompts for the KL reported every eval_every steps
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    device: str | None = None  # None: cuda when available
    encoding_passage: str | None = DEFAULT_ENCODING_PASSAGE  # as the engine that will serve the tuned model
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    progress: bool = False
    time_limit: float | None = (
        None  # seconds: past it, checkpoint and write the adapter as far as it got (rerun to go on)
    )
    activation_checkpointing: bool = True  # False: keep every layer's activations (faster, far more memory)

    def __post_init__(self):
        if self.method not in ("lora", "full"):
            raise ValueError(f"method must be lora or full; got {self.method!r}")
        if self.max_steps < 1 or self.prompts_per_step < 1 or self.answer_tokens < 1:
            raise ValueError("max_steps, prompts_per_step and answer_tokens must be at least 1")
        unknown = set(self.sets) - set(DATASETS)
        if unknown or not self.sets:
            raise ValueError(f"sets must be some of {', '.join(DATASETS)}; got {', '.join(self.sets) or 'none'}")
        self.passages = tuple(int(p) for p in self.passages)
        self.sets = tuple(self.sets)
        if self.learning_rate is None:
            self.learning_rate = 2e-4 if self.method == "lora" else 2e-5

    def identity(self) -> dict:
        """What a resumed run must share with the interrupted one (as JSON reads it back: lists, not tuples)."""
        return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k not in RESUMABLE}))


@dataclass
class TuneResult:
    out: Path
    steps: int
    seconds: float
    dev_kl: dict  # base lazy, tuned lazy, tuned full: KL to base full prefill on the held-out prompts

    def summary(self) -> str:
        kl = self.dev_kl
        return (
            f"tuned {self.steps} steps in {self.seconds:.0f} s -> {self.out}\n"
            f"KL to the base model's full prefill on {kl.get('prompts', 0)} held-out prompts: lazy "
            f"{kl.get('base_lazy', float('nan')):.4f} (base) -> {kl.get('tuned_lazy', float('nan')):.4f} (tuned); "
            f"tuned full prefill {kl.get('tuned_full', float('nan')):.4f}"
        )


def kl_to(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), both logits ``[N, V]``."""
    t = teacher.float().log_softmax(-1)
    s = student.float().log_softmax(-1)
    return (t.exp() * (t - s)).sum(-1).mean()


class Tuner:
    """One tuning run: the model, its teacher, the prompts and the optimiser, checkpointed as it goes."""

    def __init__(self, config: TuneConfig):
        from lazyrag.model.loader import load_checkpoint, resolve_model_source

        self.config = c = config
        self.out = Path(c.out)
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        source = resolve_model_source(c.model)
        self.model_name = source.name
        self.base, self.tokenizer = load_checkpoint(source, torch.float32)
        self.base_id = base_id(self.base)
        self.prompts = PromptBuilder(self.tokenizer, c.system_prompt, c.encoding_passage)
        self.passage_ids = self.prompts.passage_ids()
        questions = [q for name in c.sets for q in load_questions(name, c.data.get(name))]
        train = [q for q in questions if not is_dev(q.question)]
        dev = [q for q in questions if is_dev(q.question)]
        self.sampler = PromptSampler(train, c.passages, c.seed, self.too_long)
        self.dev_sampler = PromptSampler(dev or train, c.passages, c.seed + 1, self.too_long)
        self._answers: dict[str, list[int]] | None = None
        self._engine = None

    def too_long(self, question: str, chunks: list[str]) -> bool:
        """Whether the prompt and its answer overrun the model's context (the sampler then drops distractors)."""
        layout = self.prompts.build(question, chunks)
        n = (
            max(len(layout.prefix_ids), len(layout.encoding_prefix))
            + sum(map(len, layout.chunk_ids))
            + len(layout.question_ids)
        )
        return n + self.config.answer_tokens > self.base.config.max_position_embeddings

    def train_draws(self, first_step: int, end_step: int) -> list[tuple[str, tuple[str, list[str]]]]:
        n = self.config.prompts_per_step
        return [
            (f"train:{s}:{j}", self.sampler.draw(s * n + j))
            for s in range(first_step, min(end_step, self.config.max_steps))
            for j in range(n)
        ]

    # -- teacher answers: the base model's greedy full prefill, by the engine, once ---------------------------

    def teacher_answers(self, draws: list[tuple[str, tuple[str, list[str]]]]) -> dict[str, list[int]]:
        """{draw id: answer token ids} for ``draws`` and every draw answered before, from the file where they are
        kept; the missing ones are generated now (a run answers one block of steps at a time, so a time limit
        never waits for answers to steps it will not reach)."""
        path = self.out / TEACHER_FILE
        if self._answers is None:
            self._answers = {}
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        row = json.loads(line)
                        self._answers[row["id"]] = row["answer"]
                    except (json.JSONDecodeError, KeyError):
                        break  # a line cut short by a kill: the rest is computed again
        missing = [(i, d) for i, d in draws if i not in self._answers]
        if missing:
            self._generate(missing, self._answers, path)
        return self._answers

    def teacher_engine(self):
        """The base model's engine, made once, before an adapter wraps the model (its weights are copies)."""
        if self._engine is None:
            from lazyrag.engine import LazyEngine

            c = self.config
            self._engine = LazyEngine.from_hf(
                self.base,
                self.tokenizer,
                model_name=self.model_name,
                device=self.device,
                dtype=torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                system_prompt=c.system_prompt,
                encoding_passage=c.encoding_passage,
                kv_budget=TEACHER_KV_BYTES,
                cuda_graphs=False,
                compile_elementwise=False,
            )  # a batch job beside training: no capture or compile
        return self._engine

    def _generate(self, missing, known: dict, path: Path) -> None:
        from tqdm import tqdm

        from lazyrag.engine import SamplingParams

        c = self.config
        engine = self.teacher_engine()
        eos = self.tokenizer.eos_token_id
        params = SamplingParams(max_new_tokens=c.answer_tokens, strategy="full")
        bar = tqdm(total=len(missing), desc="teacher answers", unit="prompt", disable=not c.progress, leave=False)
        with open(path, "a") as f:
            for at in range(0, len(missing), 64):
                group = missing[at : at + 64]
                reqs = [engine.add_request(engine.build_prompt(q, chunks), params) for _, (q, chunks) in group]
                while engine.has_unfinished_requests():
                    engine.step()
                for (i, _), req in zip(group, reqs):
                    r = req.result()
                    answer = list(r.token_ids) + ([eos] if r.finish_reason == "stop" and eos is not None else [])
                    known[i] = answer or [eos]
                    f.write(json.dumps({"id": i, "answer": known[i]}) + "\n")
                f.flush()
                bar.update(len(group))
        bar.close()

    # -- the model being tuned ---------------------------------------------------------------------------------

    def build_student(self):
        c = self.config
        torch.manual_seed(c.seed)  # the adapter's initial weights: a rerun with the seed starts where this one did
        if c.method == "full":
            student = trainable_copy(self.base).to(self.device).train()
            self.teacher = self.base.to(self.device).eval().requires_grad_(False)
            return student
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            self.base.to(self.device),
            LoraConfig(r=c.lora_rank, lora_alpha=c.lora_alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS)),
        )
        self.teacher = None  # the same model with its adapter off
        return model.train()

    def teacher_logits(self, student, fn, *args) -> torch.Tensor:
        with torch.no_grad():
            if self.teacher is not None:
                return fn(self.teacher, *args)
            with student.disable_adapter():
                return fn(student, *args)

    def examples(self, draws, answers) -> list[Example]:
        return [Example(self.prompts.build(q, chunks), answers[i]) for i, (q, chunks) in draws]

    def _autocast(self):
        return (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )

    def dev_kl(self, student, examples: list[Example], base: bool = False) -> dict:
        """KL to base full prefill of tuned lazy and tuned full (``base``: also of the base model's lazy)."""
        out: dict[str, float] = {"prompts": len(examples)}
        was = student.training
        student.eval()
        with torch.no_grad(), self._autocast():
            sums = {"tuned_lazy": 0.0, "tuned_full": 0.0, "base_lazy": 0.0}
            for at in range(0, len(examples), self.config.prompts_per_step):
                batch = examples[at : at + self.config.prompts_per_step]
                n = sum(len(e.targets) for e in batch)
                t = self.teacher_logits(student, full_logits, batch)
                sums["tuned_lazy"] += n * kl_to(t, lazy_logits(student, batch, self.passage_ids)).item()
                sums["tuned_full"] += n * kl_to(t, full_logits(student, batch)).item()
                if base:
                    sums["base_lazy"] += (
                        n * kl_to(t, self.teacher_logits(student, lazy_logits, batch, self.passage_ids)).item()
                    )
            total = sum(len(e.targets) for e in examples)
            out.update({k: v / total for k, v in sums.items() if base or k != "base_lazy"})
        student.train(was)
        return out

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_weights(self, student, folder: Path) -> None:
        if self.config.method == "lora":
            student.save_pretrained(folder)
        else:
            student.save_pretrained(folder, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)

    def checkpoint(self, student, optimizer, scheduler, step: int, history: list) -> None:
        """The run's state, written beside the last one and swapped in by renames: a kill leaves one whole."""
        tmp, final, old = self.out / f".{CHECKPOINT}.tmp", self.out / CHECKPOINT, self.out / f".{CHECKPOINT}.old"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        trainable = {k: v.detach().cpu() for k, v in student.named_parameters() if v.requires_grad}
        torch.save(
            {
                "step": step,
                "weights": trainable,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "history": history,
                "identity": self.config.identity(),
            },
            tmp / "state.pt",
        )
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def restore(self, student, optimizer, scheduler) -> tuple[int, list]:
        """(step, history) of the checkpoint in ``out``, its state loaded; (0, []) when there is none."""
        for folder in (self.out / CHECKPOINT, self.out / f".{CHECKPOINT}.old"):  # .old: killed between the renames
            state_file = folder / "state.pt"
            if not state_file.is_file():
                continue
            state = torch.load(state_file, map_location="cpu", weights_only=False)
            if state["identity"] != self.config.identity():
                diff = sorted(k for k in state["identity"] if state["identity"][k] != self.config.identity().get(k))
                raise ValueError(
                    f"{self.out} holds a tuning run with other settings ({', '.join(diff)}); rerun with its "
                    "settings to resume it, or choose a new --out folder."
                )
            params = dict(student.named_parameters())
            with torch.no_grad():
                for k, v in state["weights"].items():
                    params[k].copy_(v.to(params[k].device))
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            return state["step"], state["history"]
        return 0, []

    # -- the run -----------------------------------------------------------------------------------------------

    def run(self) -> TuneResult:
        c = self.config
        t0 = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        finished = self.out / TUNE_FILE
        done = self._finished(finished)
        if done is not None:
            return done
        dev_draws = [(f"dev:{j}", self.dev_sampler.draw(j)) for j in range(c.dev_prompts)]
        self.teacher_engine()  # before the adapter wraps the base model
        answers = self.teacher_answers(dev_draws)
        student = self.build_student()
        params = [p for p in student.parameters() if p.requires_grad]
        assert c.learning_rate is not None  # __post_init__ set the method's default
        optimizer = torch.optim.AdamW(params, lr=c.learning_rate, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_schedule(c))
        step, history = self.restore(student, optimizer, scheduler)
        dev = self.examples(dev_draws, answers)
        if step == 0 and dev:
            history.append({"step": 0, **self.dev_kl(student, dev, base=True)})
            self._log(history[-1])
        step = self._train(student, optimizer, scheduler, step, history, dev, answers, t0)
        self._engine = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if step < c.max_steps:
            log.info("lazyrag tune stopped at step %d of %d (time limit); rerun to go on", step, c.max_steps)
        last_dev: dict[str, float] = next((h for h in reversed(history) if "tuned_lazy" in h), {})
        dev_kl = {
            **next((h for h in history if h["step"] == 0 and "base_lazy" in h), {}),
            **{k: v for k, v in last_dev.items() if k in ("tuned_lazy", "tuned_full", "prompts")},
        }
        dev_kl.pop("step", None)
        self.save_weights(student, self.out)
        record = {
            "base_model": self.model_name,
            "base_id": self.base_id,
            "method": c.method,
            "encoding_passage": passage_label(c.encoding_passage),
            "encoding_passage_sha256": passage_sha256(c.encoding_passage),
            "steps": step,
            "finished": step >= c.max_steps,
            "dev_kl": dev_kl,
            "identity": c.identity(),
            "seconds": time.perf_counter() - t0,
        }
        tmp = finished.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, finished)
        return TuneResult(self.out, step, time.perf_counter() - t0, dev_kl)

    def _train(self, student, optimizer, scheduler, step: int, history: list, dev: list, answers: dict, t0) -> int:
        """Train from ``step`` to max_steps, or until the time limit, logging to ``history`` and checkpointing; the
        step it reached."""
        from tqdm import tqdm

        c = self.config
        bar = tqdm(total=c.max_steps, initial=step, desc="tune", unit="step", disable=not c.progress)
        while step < c.max_steps:
            if c.time_limit is not None and time.perf_counter() - t0 > c.time_limit:
                if dev:
                    history.append({"step": step, **self.dev_kl(student, dev)})
                    self._log(history[-1])
                self.checkpoint(student, optimizer, scheduler, step, history)
                break
            if f"train:{step}:0" not in answers:
                answers = self.teacher_answers(self.train_draws(step, step + TEACHER_BLOCK))
            batch = self.examples(self.train_draws(step, step + 1), answers)
            row = self.train_step(student, optimizer, scheduler, batch)
            step += 1
            bar.update(1)
            bar.set_postfix(kl_lazy=f"{row['kl_lazy']:.4f}", kl_full=f"{row['kl_full']:.4f}")
            row = {"step": step, **row, "seconds": round(time.perf_counter() - t0, 2)}
            if dev and (step % c.eval_every == 0 or step == c.max_steps):
                row.update(self.dev_kl(student, dev))
            history.append(row)
            self._log(row)
            if step % c.save_every == 0 or step == c.max_steps:
                self.checkpoint(student, optimizer, scheduler, step, history)
        bar.close()
        return step

    def _finished(self, finished: Path) -> TuneResult | None:
        """The result recorded in ``finished`` when it is a finished run of these settings, else None."""
        if not finished.is_file():
            return None
        done = json.loads(finished.read_text())
        if done.get("identity") != self.config.identity() or not done.get("steps", 0) >= self.config.max_steps:
            return None
        return TuneResult(self.out, done["steps"], 0.0, done.get("dev_kl", {}))

    def train_step(self, student, optimizer, scheduler, batch: list[Example]) -> dict:
        """One optimiser step on ``batch``: KL of the student's ``lazy`` (and, weighted, full prefill) logits to the
        base model's full prefill; returns the losses and the learning rate used."""
        from torch.profiler import record_function  # named ranges for benchmarks/tune_step_gpu.py's profile

        c = self.config
        with self._autocast(), activation_checkpointing(c.activation_checkpointing):
            with record_function("tune.teacher"):
                t = self.teacher_logits(student, full_logits, batch)
            with record_function("tune.lazy_forward"):
                loss_lazy = kl_to(t, lazy_logits(student, batch, self.passage_ids))
            with record_function("tune.full_forward"):
                loss_full = (
                    kl_to(t, full_logits(student, batch)) if c.full_weight else torch.zeros((), device=self.device)
                )
            loss = loss_lazy + c.full_weight * loss_full
        optimizer.zero_grad(set_to_none=True)
        with record_function("tune.backward"):
            loss.backward()
        with record_function("tune.optimizer"):
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
        return {"loss": loss.item(), "kl_lazy": loss_lazy.item(), "kl_full": loss_full.item(), "lr": lr}

    def _log(self, row: dict) -> None:
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def trainable_copy(model):
    """A copy of ``model`` for full fine-tuning, which ``save_pretrained`` writes as a plain safetensors folder.

    A GGUF checkpoint is dequantized when transformers loads it, so its weights are ordinary tensors; but the model
    stays marked with its GGUF quantizer, and ``save_pretrained`` refuses any model so marked. The copy drops the
    marker (the original keeps it)."""
    import copy

    student = copy.deepcopy(model)
    method = getattr(getattr(getattr(student, "hf_quantizer", None), "quantization_config", None), "quant_method", None)
    if str(getattr(method, "value", method)) == "gguf":
        student.hf_quantizer = None
        student.config.__dict__.pop("quantization_config", None)
    return student


def _lr_schedule(c: TuneConfig) -> Callable[[int], float]:
    """The learning rate's factor at each step: linear warm-up, then cosine down to a tenth."""

    def lr_at(step: int) -> float:
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        t = (step - c.warmup_steps) / max(1, c.max_steps - c.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))

    return lr_at


def tune(config: TuneConfig | None = None, **fields) -> TuneResult:
    """Tune a model for ``lazy`` (see the module docstring); ``fields``: TuneConfig's. Rerun to resume."""
    return Tuner(config or TuneConfig(**fields)).run()
