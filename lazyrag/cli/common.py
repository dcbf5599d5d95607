"""What the subcommands share: the help formatter, the flags several commands take (the model, its adapter and cache,
the encoding passage, tensor parallelism, a store's embedder) and the engine keywords they become, the checks made
before a model loads, and ``--config`` YAML files."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from lazyrag.defaults import CACHE_DIR_ENV, MAX_K, MODEL_CACHE_ENV


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default in its help: ``(default: X)`` is appended unless the
    help already says what the default is (argparse's ArgumentDefaultsHelpFormatter, minus noise such as
    ``(default: None)`` after a help that explains it, and ``False`` after an on/off flag)."""

    def _get_help_string(self, action):
        help = action.help or ""
        if (
            "%(default)" in help
            or "default" in help
            or action.default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return help
        if action.default is None or action.default is False or action.default == []:
            return help
        return help + " (default: %(default)s)"


MODEL_HELP = (
    "local model folder of Llama, Mistral, Qwen2/2.5 or Qwen3 (config.json + safetensors), .gguf file, or Hugging "
    "Face model id found in the local "
    "Hugging Face cache (HF_HUB_CACHE; never downloaded); default: the embedded SmolLM2-135M-Instruct"
)


# -- flags several commands take, and the engine keywords they become --


def size_arg(flag: str):
    """An argparse type: a byte size (lazyrag/sizes.py), or the parser's own error naming ``flag``."""

    def parse(value: str) -> int:
        from lazyrag.sizes import parse_bytes

        try:
            return parse_bytes(value, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)"
    )
    model_cache_arg(p)


def model_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-model-cache",
        action="store_true",
        help=f"read a .gguf model from the file on every load instead of converting it once into "
        f"${CACHE_DIR_ENV}/models (default: ~/.cache/lazyrag/models); the same as {MODEL_CACHE_ENV}=0",
    )


def adapter_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--adapter",
        default=None,
        metavar="FOLDER|embedded|none",
        help="a LoRA adapter from `lazyrag tune`, merged into the model at load (the model's fingerprint then "
        "differs: stores and caches of the base model are refused for it); `embedded`: the one shipped "
        "for the embedded model, tuned so that `lazy` answers more like a full prefill (needs peft: "
        "pip install 'lazyrag[tune]'); none (the default): the model as it is",
    )


def adapter_kwargs(args) -> dict:
    """Engine keyword for ``--adapter`` (none: no keyword)."""
    adapter = getattr(args, "adapter", None)
    return {"adapter": adapter} if adapter and adapter.lower() != "none" else {}


def passage_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encoding-passage",
        default=None,
        metavar="default|none|FILE",
        help="what chunks are encoded after besides the prompt's prefix: default = three short neutral documents "
        "(a chunk's KV then reads as if other documents came first: closer to full prefill), none = the "
        "prefix alone (stores built before passages existed), or a text file's contents (documents "
        "separated by blank lines). Part of a store's identity: with --store, the store's unless given "
        "(default: default)",
    )


def passage_kwargs(args) -> dict:
    """Engine keyword for ``--encoding-passage``; unset with an opened ``--store``, the store's passage."""
    choice = getattr(args, "encoding_passage", None)
    store = getattr(args, "store", None)
    if choice is None and store is not None and hasattr(store, "manifest"):
        m = store.manifest
        if not m.passage_ids:
            return {"encoding_passage": None}
        return (
            {"encoding_passage": m.encoding_passage} if m.encoding_passage else {}
        )  # no text kept: the store says what to do
    if choice in (None, "default"):
        return {}
    if choice == "none":
        return {"encoding_passage": None}
    path = Path(choice)
    if not path.is_file():
        raise SystemExit(f"--encoding-passage {choice}: not default, none or a text file")
    text = path.read_text().strip()
    if not text:
        raise SystemExit(f"--encoding-passage {choice}: the file is empty (use none for no passage)")
    return {"encoding_passage": text}


def tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="split the model over N processes (its KV heads and MLP across ranks); this process starts the "
        "others. Under torchrun --nproc-per-node N it is N (default: 1, or torchrun's WORLD_SIZE)",
    )


def tensor_parallel_kwargs(args) -> dict:
    """Engine keywords for tensor parallelism: ``--tensor-parallel-size``, else torchrun's WORLD_SIZE."""
    size = args.tensor_parallel_size or (
        int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1
    )
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1; got {size}")
    return {"tensor_parallel_size": size} if size > 1 else {}


def store_embedder_arg(p) -> None:
    p.add_argument(
        "--embedder",
        default=None,
        metavar="NAME_OR_FOLDER",
        help="the embedder of --store, when the store was built with a local model folder (precache --embedder): "
        "lazyrag loads a folder only when you name it, and it must be the one the store names "
        "(default: the store's, if it is the embedded default)",
    )


# -- argument checks that need no model: a mistake is reported in a second, not after the load --


class UsageError(ValueError):
    """A command-line argument that cannot work; the message says what to pass instead."""


def check_model(model: str | None) -> None:
    """A model that cannot be found is reported before anything loads (a hub id: looked up in the local cache)."""
    if model is not None and not Path(model).expanduser().exists():
        from lazyrag.model.loader import ModelLoadError, resolve_model_source  # no torch

        try:
            resolve_model_source(model)
        except ModelLoadError as e:
            raise UsageError(str(e)) from None


def check_store(store: Path):
    from lazyrag.store.corpus import CorpusStore

    return CorpusStore.open(store)  # StoreError (what to do) for a missing, foreign or unfinished store


def check_embedder(args) -> None:
    """The store's embedder, or the one ``--embedder`` names, settled before the model loads (StoreError: what to
    pass)."""
    if args.store is None:
        if args.embedder is not None:
            raise UsageError("--embedder names the embedder of --store; pass it with --store.")
        return
    from lazyrag.store.retriever import store_embedder

    args.embedder = store_embedder(args.store, args.embedder)


def check_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise UsageError(f"--k {k} must be from 1 to {MAX_K} (chunks retrieved per question).")


def require(command: str, *modules: str) -> None:
    """lazyrag.extras.require as a usage error: the command's optional modules, and the extra that installs them."""
    from lazyrag.extras import MissingExtra, require

    try:
        require(command, *modules)
    except MissingExtra as e:
        raise UsageError(str(e)) from None


# -- options from a YAML file (serve --config), as vLLM reads them --


def config_argv(parser: argparse.ArgumentParser, path: str, drop_model: bool) -> list[str]:
    """The options of a ``--config`` YAML file as command-line arguments, to be parsed before the real ones (which
    then win). Keys are the parser's long option names, with dashes or underscores; anything else is refused."""
    data = _read_config(path)
    actions = {
        o[2:]: a
        for a in parser._actions
        for o in a.option_strings
        if o.startswith("--") and o not in ("--help", "--config")
    }
    unknown = [str(k) for k in data if str(k).replace("_", "-") not in actions]
    if unknown:
        raise UsageError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}. Valid keys, the options of "
            f"`lazyrag {parser.prog.split()[-1]}` (dashes or underscores): {', '.join(sorted(actions))}."
        )
    argv = []
    for key, value in data.items():
        name = str(key).replace("_", "-")
        action, flag = actions[name], f"--{name}"
        if value is None or (drop_model and action.dest == "model"):
            continue  # the command line's MODEL or --model wins
        if action.nargs == 0:  # an on/off flag
            if not isinstance(value, bool):
                raise UsageError(f"--config {path}: {key} is an on/off option; give true or false, not {value!r}.")
            argv += [flag] if value else []
        elif isinstance(value, (list, tuple)) and (
            isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
        ):
            argv += (
                [f"{flag}={v}" for v in value]
                if isinstance(action, argparse._AppendAction)
                else [flag, *map(str, value)]
            )
        elif isinstance(value, (list, tuple, dict)):
            argv.append(f"{flag}={json.dumps(value)}")
        else:
            argv.append(f"{flag}={str(value).lower() if isinstance(value, bool) else value}")
    return argv


def _read_config(path: str) -> dict:
    """A ``--config`` file's mapping of option names to values (empty for an empty file)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror or e}).") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path} is not valid YAML: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise UsageError(
            f"--config {path} must hold option names and values (e.g. `port: 8001`), not a {type(data).__name__}."
        )
    return data


def with_config(parser: argparse.ArgumentParser, argv: list[str], args):
    """``args`` again with the ``--config`` file's options under the command line's."""
    assert parser._subparsers is not None  # the commands' subparsers
    subparsers = parser._subparsers._group_actions[0]
    assert isinstance(subparsers, argparse._SubParsersAction)
    command = subparsers.choices[args.command]
    at = argv.index(args.command) + 1
    given = args.model is not None or getattr(args, "model_tag", None) is not None
    return parser.parse_args(argv[:at] + config_argv(command, args.config, drop_model=given) + argv[at:])
