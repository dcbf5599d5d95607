"""A GGUF checkpoint converted once, then loaded from a cache folder: safetensors weights, ``config.json`` and the
tokenizer's files, in the engine's dtype.

Why: transformers reads a GGUF slowly. It parses the file's metadata for the config, again for the weights and
again for the tokenizer, and de-quantises every tensor in Python: 20-47 s for the embedded 135M model on 2 CPU
cores, on every load. The converted folder loads in well under a second.

Where: ``$LAZYRAG_CACHE_DIR/models/<name>-<key>/`` (default ``$XDG_CACHE_HOME/lazyrag``, else ``~/.cache/lazyrag``).
The key is a hash of what the conversion depends on: the GGUF's content (sha256) and file name (transformers puts
the name in the config, and so in the fingerprint), the transformers version that converts it, the dtype and this
module's format. A GGUF whose content changes gets another folder: stale weights are never read.

Safety: a folder is written under a temporary name and renamed into place when complete, so a process killed
mid-write leaves nothing that is later trusted (its leftovers are removed by the next writer). A folder is trusted
only if its manifest matches the key's inputs, every file has the size it was written with, the small files (config,
tokenizer) their sha256, and the weights give the fingerprint recorded at conversion (a strided sample of every
tensor: hashing 540 MB whole would cost a fifth of the load); otherwise it is discarded (logged) and converted again.
The engine's fingerprint is the same from the GGUF and from the cache (the conversion checks that the config reads
back as written).

Off: ``LAZYRAG_MODEL_CACHE=0``, ``model_cache=False`` on the engine, or ``--no-model-cache`` on the command line.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Callable

import torch

from lazyrag.defaults import CACHE_DIR_ENV, MODEL_CACHE_ENV
from lazyrag.kv.tiers import current_umask
from lazyrag.model.loader import (
    ModelSource,
    SavedConfig,
    check_llama_config,
    fingerprint,
    fingerprinted_config,
    load_checkpoint,
    stream_state,
)

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a folder holds changes: older folders are then left alone and converted again
MANIFEST = "lazyrag-model.json"  # written last: a folder without it was never finished
WEIGHTS = "model.safetensors"
_TEMP = ".tmp-"  # prefix of folders being written: ``.tmp-<final name>-<host>-<pid>-<random>``
_OFF = ("0", "false", "no", "off")


def cache_enabled() -> bool:
    """Whether the environment leaves the cache on (``EngineConfig.model_cache``'s default): unless
    ``LAZYRAG_MODEL_CACHE`` is 0, false, no or off."""
    return os.environ.get(MODEL_CACHE_ENV, "1").strip().lower() not in _OFF


def cache_root() -> Path:
    """lazyrag's cache folder: ``$LAZYRAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/lazyrag``, else ``~/.cache/lazyrag``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "lazyrag"


def models_dir() -> Path:
    return cache_root() / "models"


def cache_folder(source: ModelSource, dtype: torch.dtype, adapter: str | Path | None = None) -> Path:
    """Where ``source`` (a GGUF), with ``adapter`` merged if given, converted for ``dtype`` is cached (whether or
    not it is there yet)."""
    return _folder(_identity(source, dtype, adapter))


def _folder(identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    merged = "-tuned" if "adapter_sha256" in identity else ""
    return models_dir() / f"{Path(identity['gguf_file']).stem}{merged}-{identity['dtype']}-{key}"


def load(
    source: ModelSource,
    dtype: torch.dtype,
    keep: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    adapter: str | Path | None = None,
):
    """(config, tokenizer, state dict, fingerprint) of a GGUF checkpoint: from the cache, or converted by transformers
    and cached for the next load. ``keep(name, tensor)``: the part of each tensor to hold (tensor parallelism);
    the fingerprint is always the whole model's. ``adapter``: a ``lazyrag tune`` LoRA (a folder, or "embedded"),
    merged in float32 at the conversion; the merged model is what is cached, under the adapter's content digest."""
    identity = _identity(source, dtype, adapter)
    folder = _folder(identity)
    found = _open(folder, identity, dtype, keep)
    if found is not None:
        return found
    log.warning(
        "converting %s%s once into the model cache at %s (later loads read it in about a second; "
        "LAZYRAG_MODEL_CACHE=0 turns the cache off)",
        source.name,
        "" if adapter is None else " with its adapter merged",
        folder,
    )
    if adapter is None:
        hf, tokenizer = load_checkpoint(source, dtype)
    else:
        from lazyrag.tune.adapter import apply_adapter

        hf, tokenizer = load_checkpoint(source, torch.float32)  # merged in float32, then cast once
        hf = apply_adapter(hf, adapter)
    state = {k: v.detach().to(dtype) for k, v in hf.state_dict().items()}
    config, fp = hf.config, fingerprint(hf.config, state, dtype)  # as ``LazyEngine.from_hf`` hashes the model
    del hf
    try:
        _write(folder, identity, config, tokenizer, state, fp)
    except OSError as e:  # a full disk or a read-only home: this load goes on from memory
        log.warning(
            "could not write the model cache at %s (%s); the next load converts %s again. Free space, point "
            "%s to a writable folder, or set %s=0.",
            folder,
            e,
            source.name,
            CACHE_DIR_ENV,
            MODEL_CACHE_ENV,
        )
    return config, tokenizer, {k: v if keep is None else keep(k, v) for k, v in state.items()}, fp


def _identity(source: ModelSource, dtype: torch.dtype, adapter: str | Path | None = None) -> dict:
    """What a converted folder depends on: it is valid only where all of these are equal."""
    assert source.gguf_file is not None  # a GGUF source
    path = source.folder / source.gguf_file
    identity = {
        "format": FORMAT,
        "gguf_file": source.gguf_file,
        "gguf_sha256": gguf_sha256(path),
        "gguf_bytes": path.stat().st_size,
        "transformers": importlib.metadata.version("transformers"),
        "dtype": str(dtype).replace("torch.", ""),
    }
    if adapter is not None:  # the base model's folder keeps the key it had before adapters were cached
        from lazyrag.extras import require
        from lazyrag.tune.adapter import adapter_sha256

        require("Loading an adapter", "peft")
        identity["adapter_sha256"] = adapter_sha256(adapter)
        identity["peft"] = importlib.metadata.version("peft")
    return identity


# -- the GGUF's digest -------------------------------------------------------------------------


def gguf_sha256(path: Path) -> str:
    """The file's sha256, remembered per (device, inode, size, mtime, ctime): a file that is written again, renamed
    over, or touched back to its old mtime gets a new ctime, which nobody can set, so it is hashed again."""
    path = Path(path)
    st = path.stat()
    stamp = [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    memo = models_dir() / ".sha256" / (hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32] + ".json")
    try:
        seen = json.loads(memo.read_text())
        if seen.get("stamp") == stamp and isinstance(seen.get("sha256"), str):
            return seen["sha256"]
    except (OSError, ValueError):
        pass  # not hashed yet (or an unreadable memo): hash it
    digest = _file_sha256(path)
    with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
        _write_json(memo, {"stamp": stamp, "sha256": digest})
    return digest


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


# -- reading a folder ----------------------------------------------------------------------------


def _open(folder: Path, identity: dict, dtype: torch.dtype, keep):
    """The folder's (config, tokenizer, state, fingerprint), or None: absent, or corrupt (then discarded, logged)."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        if folder.exists():
            _discard(folder, f"it has no {MANIFEST}")
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        problem = _manifest_problem(folder, manifest, identity)
        if problem is None:
            config, tokenizer, state, fp = _read(folder, manifest, dtype, keep)
            if fp != manifest["fingerprint"]:
                problem = f"its weights give fingerprint {fp}, not the {manifest['fingerprint']} written with them"
    except Exception as e:  # noqa: BLE001 - a damaged file fails in whatever reads it first; every failure means "convert again"
        problem = f"it could not be read ({type(e).__name__}: {e})"
    if problem is not None:
        _discard(folder, problem)
        return None
    return config, tokenizer, state, fp


def _manifest_problem(folder: Path, manifest: dict, identity: dict) -> str | None:
    """Why the folder is not the finished conversion of ``identity``; None if it is."""
    if not isinstance(manifest, dict) or {k: manifest.get(k) for k in identity} != identity:
        return "its manifest is not this GGUF's conversion"
    for name, size in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or has another size than it was written with"
    for name, digest in manifest.get("sha256", {}).items():
        if _file_sha256(folder / name) != digest:
            return f"{name} has other contents than it was written with"
    return None


def _read(folder: Path, manifest: dict, dtype: torch.dtype, keep):
    from safetensors import safe_open

    config = SavedConfig.read(folder / "config.json")
    check_llama_config(config, folder.name)
    tied = manifest["tied"]  # names transformers' state dict holds twice (tied embeddings): stored once
    with safe_open(str(folder / WEIGHTS), framework="pt") as weights:
        names = list(weights.keys()) + list(tied)
        state, fp = stream_state(lambda name: weights.get_tensor(tied.get(name, name)), names, config, dtype, keep)
    return config, _tokenizer(folder), state, fp


def _tokenizer(folder: Path):
    """The tokenizer as saved, through the class it was saved from: AutoTokenizer would first read config.json
    through the model's config class, whose import costs ~0.9 s on 2 cores."""
    import transformers

    name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return (cls or transformers.AutoTokenizer).from_pretrained(folder)


# -- writing a folder ----------------------------------------------------------------------------


def _write(folder: Path, identity: dict, config, tokenizer, state: dict[str, torch.Tensor], fp: str) -> None:
    """Write the folder atomically: a temporary one, renamed into place once complete."""
    from safetensors.torch import save_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(folder.parent)
    tmp = folder.parent / f"{_TEMP}{folder.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        unique, tied = _untie(state)
        save_file(unique, str(tmp / WEIGHTS), metadata={"format": "pt"})
        os.chmod(
            tmp / WEIGHTS, 0o666 & ~current_umask()
        )  # safetensors writes it private; the folder's others follow the umask
        (tmp / "config.json").write_text(config.to_json_string(use_diff=False))
        _check_config_reads_back(tmp, config)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        # the small files are hashed whole; the weights (0.4 s to hash for the 135M model) by the fingerprint's sample
        digests = {name: _file_sha256(tmp / name) for name in files if name != WEIGHTS}
        _write_json(tmp / MANIFEST, {**identity, "fingerprint": fp, "tied": tied, "files": files, "sha256": digests})
        _sync(tmp)
        _install(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed


def _untie(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(each tensor once, {other name: the name it is stored under}): safetensors refuses a tensor saved twice."""
    unique: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[int, int | torch.SymInt, tuple[int, ...]], str] = {}
    for name in sorted(state):
        t = state[name]
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ptr in seen:
            tied[name] = seen[ptr]
        else:
            seen[ptr] = name
            unique[name] = t.contiguous()
    return unique, tied


def _check_config_reads_back(folder: Path, config) -> None:
    """The engine's fingerprint hashes the config: the cached one must read back as the one transformers made
    from the GGUF, or a store built from one load would be refused by the other."""
    if fingerprinted_config(SavedConfig.read(folder / "config.json")) != fingerprinted_config(config):
        raise OSError("the converted config does not read back as written with this transformers version")


def _install(tmp: Path, folder: Path) -> None:
    """Rename the finished ``tmp`` to ``folder``. Another process that converted the same GGUF at the same time
    may have won: its folder is as good as ours, keep it."""
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / MANIFEST).is_file():
            raise


def _discard(folder: Path, why: str) -> None:
    log.warning("discarding the model cache at %s: %s; converting the GGUF again", folder, why)
    doomed = folder.parent / f"{_TEMP}{folder.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(folder, doomed)  # out of the way at once: no other reader trusts it while it is being deleted
    except OSError:
        return  # another process discarded (or replaced) it first
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_dead_temps(parent: Path) -> None:
    """Remove the temporary folders of writers on this host that no longer run (killed mid-write)."""
    host = socket.gethostname()
    for tmp in parent.glob(f"{_TEMP}*"):
        head, pid, _ = (tmp.name.rsplit("-", 2) + ["", ""])[:3]
        if head.endswith(f"-{host}") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _write_json(path: Path, data: dict) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sync(folder: Path) -> None:
    """Flush the files to disk before the rename makes them trusted (a power cut otherwise can leave the manifest
    without the data it describes)."""
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
