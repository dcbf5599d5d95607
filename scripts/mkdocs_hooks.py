"""mkdocs hooks (mkdocs.yml ``hooks:``): what the docs site builds from the current code, never from a committed copy.

* ``reference/cli.md`` is generated from the real argparse parser (``lazyrag.cli.build_parser``): every
  subcommand's ``--help`` as the command prints it.
* mkdocstrings reads the sources statically from ``build/docs-src/`` (there while a build runs): links that put the top-level
  ``integrations/`` folder where the wheel installs it (``lazyrag.integrations``; see setup.py), so the API reference
  names it as users import it.
* the benchmark plots in ``benchmarks/results/*.png`` are served as ``assets/results/*.png`` (no copies in docs/).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
MOUNTED = {"integrations": "integrations"}  # setup.py's MOUNTED, under lazyrag/
SOURCE_TREE = ROOT / "build" / "docs-src"
CLI_PAGE = "reference/cli.md"
PLOTS = ROOT / "benchmarks" / "results"


def on_startup(command, dirty):  # noqa: ARG001 (mkdocs' signature)
    source_tree()  # before mkdocstrings reads its configured paths


def on_shutdown():
    shutil.rmtree(SOURCE_TREE, ignore_errors=True)  # nothing left in build/ for setuptools to walk
    try:
        SOURCE_TREE.parent.rmdir()  # build/, if this hook made it
    except OSError:
        pass


def source_tree() -> Path:
    """``build/docs-src/lazyrag``: links to every entry of ``lazyrag/``, plus the mounted folders."""
    pkg = SOURCE_TREE / "lazyrag"
    if SOURCE_TREE.exists():
        shutil.rmtree(SOURCE_TREE)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "lazyrag").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in MOUNTED.items():
        (pkg / name).symlink_to(ROOT / folder)
    return SOURCE_TREE


def on_files(files, config):
    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    for plot in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"assets/results/{plot.name}", abs_src_path=str(plot)))
    return files


def _help(parser: argparse.ArgumentParser) -> str:
    return parser.format_help().rstrip()


def cli_reference() -> str:
    """The command line's reference page, from ``lazyrag.cli.build_parser()`` as it is now."""
    sys.path.insert(0, str(ROOT))  # this checkout's lazyrag, even where another one is installed
    try:
        before = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "110"  # argparse wraps help to the terminal's width: fixed, so builds agree
        from lazyrag.cli import build_parser

        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {c.dest: c.help for c in sub._choices_actions}
        lines = ["# Command line", "",
                 "Generated when the site is built, from the parser `lazyrag` itself runs (`lazyrag.cli.build_parser`): "
                 "each section is what `lazyrag COMMAND --help` prints. `python -m lazyrag` is the same command.", "",
                 "| command | what it does |", "| --- | --- |"]
        lines += [f"| [`lazyrag {name}`](#lazyrag-{name}) | {helps.get(name, '')} |" for name in sub.choices]
        lines += ["", "## lazyrag", "", "```text", _help(parser), "```", ""]
        for name, p in sub.choices.items():
            lines += [f"## lazyrag {name}", "", "```text", _help(p), "```", ""]
        return "\n".join(lines)
    finally:
        sys.path.remove(str(ROOT))
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
