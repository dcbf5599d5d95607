"""Loading what ``lazyrag tune`` made: a peft LoRA adapter merged into its base model at load.

The merged weights are what the engine fingerprints, so KV, caches and corpus stores made with the base model
are refused for the tuned one, and the reverse (the store's error says what to do). An adapter records the
base it was tuned from (``lazyrag_tune.json``); another base is refused, since a LoRA only means something on
the weights it was trained against.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from lazyrag.extras import require

TUNE_FILE = "lazyrag_tune.json"
EMBEDDED = "embedded"  # the adapter shipped for the embedded default model (SmolLM2-135M-Instruct)
EMBEDDED_FOLDER = Path(__file__).resolve().parent.parent / "data" / "adapters" / "smollm2-135m-instruct-lazy"


def adapter_folder(adapter: str | Path) -> Path:
    """The folder of ``adapter``: a path, or ``"embedded"`` for the one shipped with the package."""
    return EMBEDDED_FOLDER if str(adapter) == EMBEDDED else Path(adapter)


def adapter_sha256(adapter: str | Path) -> str:
    """The content digest of an adapter folder (its config and weights, not where it lies): what an eval's
    checkpoint records, so that a resume under another adapter, or none, is refused."""
    folder = checked_adapter_folder(adapter)
    digest = hashlib.sha256()
    for f in sorted(folder.glob("adapter_*")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def base_id(hf_model) -> str:
    """The base model's identity as an adapter records it: its fingerprint in bfloat16, whatever dtype it was
    loaded in (a float32 and a bfloat16 load of one checkpoint agree)."""
    from lazyrag.model.loader import Fingerprint

    state = hf_model.state_dict()
    fp = Fingerprint(hf_model.config, torch.bfloat16)
    for name in sorted(state):  # fingerprint()'s order, one tensor cast at a time: no second copy of the model
        fp.add(name, state[name].detach().to(torch.bfloat16))
    return fp.hexdigest()


def read_record(path: str | Path) -> dict:
    """What ``lazyrag tune`` wrote about the adapter in ``path`` ({} for a peft adapter made elsewhere)."""
    f = Path(path) / TUNE_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def checked_adapter_folder(adapter: str | Path) -> Path:
    """The folder of ``adapter``, refused with what to do if it holds no LoRA adapter."""
    path = adapter_folder(adapter)
    if not (path / "adapter_config.json").is_file():
        hint = (
            " It holds a whole model: pass it as the model instead (--model / from_pretrained(path))."
            if (path / "config.json").is_file()
            else ""
        )
        raise ValueError(
            f"{path} is not a LoRA adapter (no adapter_config.json); make one with `lazyrag tune --out {path}`.{hint}"
        )
    return path


def apply_adapter(hf_model, adapter: str | Path):
    """``hf_model`` with the LoRA adapter in ``adapter`` (a folder, or ``"embedded"``) merged into its weights (a
    plain transformers model again)."""
    path = checked_adapter_folder(adapter)
    require("Loading an adapter", "peft")
    from peft import PeftModel

    record = read_record(path)
    if record.get("base_id") and record["base_id"] != base_id(hf_model):
        raise ValueError(
            f"The adapter in {path} was tuned from {record.get('base_model', 'another model')} (base "
            f"{record['base_id'][:12]}), not from the model being loaded: load it on that model "
            "(--model), or tune one for this model with `lazyrag tune --model ...`."
        )
    return PeftModel.from_pretrained(hf_model, str(path)).merge_and_unload()
