"""The ``lazyrag`` command: ``main`` parses the command line and runs the subcommand. One module per subcommand
(``ask``, ``cache``, ``demo``, ``eval``, ``precache``, ``serve``, ``tune``), each with its ``add_parser(subparsers)``,
``check(args)`` (the argument checks made before a model loads) and ``run(args)``; what they share is in ``common``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from lazyrag import __version__
from lazyrag.cli import ask, cache, demo, eval as evaluate, precache, serve, tune
from lazyrag.cli.common import HelpFormatter, UsageError, with_config
from lazyrag.cli.serve import _served_names as _served_names  # tests/server/test_vllm_compat.py imports it from here
from lazyrag.defaults import MODEL_CACHE_ENV, QUIET_GGUF_ENV

DESCRIPTION = """\
lazyrag answers questions over retrieved chunks while reusing each chunk's KV cache at
whatever position the chunk lands in the prompt: every chunk is encoded once, stored once,
and its positional rotation is applied lazily inside attention.
"""

EPILOG = """\
examples:
  lazyrag demo                                  # offline, CPU, embedded SmolLM2-135M-Instruct
  lazyrag ask "Who discovered penicillin?" --chunk "Fleming found penicillin in 1928." --chunk "Tea came in 1662."
  lazyrag ask "..." --chunks-file notes.txt --strategy full     # compare with a plain full prefill
  lazyrag ask "..." --chunks-file notes.txt --model ~/models/Llama-3.1-8B-Instruct --device cuda

strategies (--strategy): lazy (default, ours), position_aware (a re-rotated copy per position),
prefix (exact token-prefix reuse only), full (no reuse; the quality reference).
"""

# the subcommands, in the order `lazyrag --help` lists them
COMMANDS = {
    "demo": demo,
    "ask": ask,
    "precache": precache,
    "cache": cache,
    "eval": evaluate,
    "serve": serve,
    "tune": tune,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazyrag", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"lazyrag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    for p in sub.choices.values():
        p.add_argument("-v", "--verbose", action="store_true", help="show model-loading progress bars and library logs")
        p.add_argument("--debug", action="store_true", help="on an error, show the full traceback too")
    return parser


def _quiet_loading(command: str) -> None:
    """No model-loading progress bars or library warnings on every start (``-v`` shows them)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # also turns off transformers' bars
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if command in ("ask", "serve"):
        # the GGUF reader's bar is a bare tqdm: only tqdm's own switch stops it
        os.environ.setdefault("TQDM_DISABLE", "1")
    elif command in ("precache", "eval"):
        # their own bars report the run's progress (--quiet there) and stay; the loader silences only the GGUF
        # reader's (model/loader.py; the variable reaches eval's worker processes too)
        os.environ.setdefault(QUIET_GGUF_ENV, "1")


def _usage_errors() -> tuple[type, ...]:
    """The errors whose message says what to do: bad input, a broken or mismatched store, a model that
    cannot load. (Read from the modules already imported: importing torch just to report is slow.)"""
    found = [ValueError, OSError]  # OSError: a full disk, a folder not writable, a file gone (its message names it)
    for module, name in (("lazyrag.store", "StoreError"), ("lazyrag.model.loader", "ModelLoadError")):
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


def _run(args) -> int:
    """The subcommand's checks (no model loaded yet), then the subcommand."""
    command = COMMANDS[args.command]
    command.check(args)
    return command.run(args)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "config", None):
        try:
            args = with_config(parser, argv, args)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    args.started = started  # serve's "ready in": the command's own time, the model load most of it
    if not args.verbose:
        _quiet_loading(args.command)
    if getattr(args, "no_model_cache", False):
        # through the environment, so it reaches every engine the command makes: eval's and tensor parallelism's
        # worker processes and the replicas' (model/checkpoint_cache.py)
        os.environ[MODEL_CACHE_ENV] = "0"
    try:
        return _run(args)
    except Exception as e:
        if args.debug or not isinstance(e, _usage_errors()):
            raise  # a bug, not a usage problem: the traceback is what is needed
        print(f"error: {e}", file=sys.stderr)
        print(f"(run `lazyrag {args.command} ... --debug` to see where it failed)", file=sys.stderr)
        return 2
