"""The README and the docs site as a user meets them: every fenced code block runs, and the site builds strictly.

Each page's blocks run in order in one temporary folder: its ``python`` blocks in one process (a block may use
what an earlier one of the page made), its ``bash`` blocks in bash (``lazyrag`` is this environment's command), on
the real embedded model. A ``bash`` block marked ``<!-- docs-test: server -->`` starts ``lazyrag serve`` in the
background on a free port (in place of the documented 8000 throughout the page), ready once ``/health`` answers,
stopped when the page's last block has run. A block that cannot run on a CPU machine is marked
``<!-- docs-test: skip (the reason) -->`` right before it; ``text`` blocks are output and are never run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import HANG_S, free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = {"python", "bash"}
OUTPUT = {"text"}  # shown output: never run
DOCUMENTED_PORT = "127.0.0.1:8000"
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip\s*\((.*)\)$")
PAGE_TIMEOUT_S = HANG_S


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directive: str | None  # the <!-- docs-test: ... --> comment right before the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        m = SKIP.match(self.directive or "")
        return m.group(1).strip() if m else None

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.directive is None or self.directive == "server"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, each with the directive comment on the line before it."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        assert end is not None, f"{page}:{i + 1}: a code fence that is never closed"
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        d = DIRECTIVE.match(prev)
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end])
        out.append(Block(page, i + 1, lang, code + "\n", d.group(1) if d else None))
        i = end + 1
    return out


def problems(page: Path) -> list[str]:
    """What is wrong with a page's blocks as the runner reads them: every block runs, is output, or says why not."""
    found, text = [], page.read_text().splitlines()
    fenced = {b.line - 1 for b in blocks(page)}
    for n, line in enumerate(text):  # a directive must stand right before a fence (blank lines allowed)
        if DIRECTIVE.match(line):
            nxt = next((j for j in range(n + 1, len(text)) if text[j].strip()), None)
            if nxt not in fenced:
                found.append(f"{page.name}:{n + 1}: a docs-test comment that is not right before a code block")
    for b in blocks(page):
        if b.lang not in RUN | OUTPUT:
            found.append(f"{b.where}: a ```{b.lang or '(no language)'} block: mark it python, bash or text")
        if b.directive is None or b.directive == "server" and b.lang == "bash" and "lazyrag serve" in b.code:
            continue
        if b.directive == "server":
            found.append(f"{b.where}: a server block is a bash block that runs `lazyrag serve`")
        elif b.skip_reason is None:
            found.append(f"{b.where}: unknown docs-test directive {b.directive!r} (skip (reason) or server)")
        elif not b.skip_reason:
            found.append(f"{b.where}: a skipped block must say why: <!-- docs-test: skip (the reason) -->")
    return found


def _driver_env() -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this environment's `lazyrag`
    return env


# Runs a page's blocks (a JSON list) in order in the current folder; prints "=== WHERE" before each.
DRIVER = r"""
import json, os, signal, subprocess, sys, time

blocks, url = json.load(open(sys.argv[1])), sys.argv[2]
scope = {"__name__": "__main__"}
server = None
try:
    for b in blocks:
        print(f"\n=== {b['where']} ({b['lang']})", flush=True)
        t0 = time.monotonic()
        if b["lang"] == "python":
            exec(compile(b["code"], b["where"], "exec"), scope)
        elif b["server"]:
            from lazyrag.server import wait_until_ready

            server = subprocess.Popen(["bash", "-c", b["code"]], start_new_session=True)
            open("server.pgid", "w").write(str(server.pid))
            deadline = time.monotonic() + 300
            while True:  # /health polled until it answers; a server that exits fails at once
                if server.poll() is not None:
                    sys.exit(f"{b['where']}: the server exited with code {server.returncode} before answering /health")
                try:
                    wait_until_ready(url, timeout_s=1)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        else:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]])
            if r.returncode:
                sys.exit(f"{b['where']}: the bash block exited with code {r.returncode}")
        print(f"--- {b['where']}: {time.monotonic() - t0:.1f} s", flush=True)
finally:
    if server is not None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
"""


def run_page(page: Path, folder: Path, timeout_s: float = PAGE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a page's runnable blocks in ``folder``; the completed driver process (its output has each block's marker)."""
    port = free_port()
    todo = []
    for b in blocks(page):
        if not b.runs:
            continue
        code = b.code.replace(DOCUMENTED_PORT, f"127.0.0.1:{port}")
        if b.directive == "server":
            code = code.replace("lazyrag serve", f"lazyrag serve --port {port}", 1)
        todo.append({"where": b.where, "lang": b.lang, "code": code, "server": b.directive == "server"})
    (folder / "blocks.json").write_text(json.dumps(todo))
    (folder / "driver.py").write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, "driver.py", "blocks.json", f"http://127.0.0.1:{port}"],
        cwd=folder,
        env=_driver_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(timed out after {timeout_s:.0f} s)"
        proc.returncode = -9
    finally:
        pgid = folder / "server.pgid"  # a server left behind by a driver that was killed
        if pgid.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pgid.read_text()), signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _failure(page: Path, r: subprocess.CompletedProcess) -> str:
    markers = re.findall(r"^=== (\S+)", r.stdout, re.M)
    return (
        f"{page.name}: block {markers[-1] if markers else '(before any block)'} "
        f"failed (exit {r.returncode}):\n{r.stdout[-6000:]}"
    )


RUNNABLE = [p for p in PAGES if any(b.runs for b in blocks(p))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_or_says_why_not(page):
    assert problems(page) == []


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_code_blocks_of_the_page_run(page, tmp_path):
    r = run_page(page, tmp_path)
    assert r.returncode == 0, _failure(page, r)
    ran = [b.where for b in blocks(page) if b.runs]
    assert re.findall(r"^=== (\S+)", r.stdout, re.M) == ran  # every runnable block, in order


def test_a_broken_snippet_fails_and_a_skip_needs_a_reason(tmp_path):
    page = tmp_path / "broken.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'the snippet is broken'\n```\n")
    r = run_page(page, tmp_path)
    assert r.returncode != 0 and "the snippet is broken" in r.stdout and "broken.md:5" in _failure(page, r)
    page.write_text("```bash\necho one\nfalse\necho never\n```\n")
    r = run_page(page, tmp_path)
    assert r.returncode != 0 and "one" in r.stdout and "never" not in r.stdout
    page.write_text(
        "<!-- docs-test: skip () -->\n```python\nx\n```\n\n```py\nx\n```\n\n<!-- docs-test: skip (why) -->\n\ntext\n"
    )
    found = "\n".join(problems(page))
    assert (
        len(problems(page)) == 3 and "must say why" in found and "```py block" in found and "not right before" in found
    )


def test_the_readme_is_short_with_absolute_images_and_working_links():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert image.startswith("https://"), f"README image {image}: PyPI shows only absolute image URLs"
    for link in re.findall(r"(?<!!)\[[^\]]*\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert link.startswith("https://") or (ROOT / link).is_file(), f"README link {link} leads nowhere"
    # CI's .ci/run calls scripts/test.sh: the two set-up commands stay as they were
    assert (
        "bash scripts/demo.sh     # installs into .venv" in text
        and "bash scripts/test.sh     # installs the test" in text
    )


@pytest.mark.slow
def test_the_docs_site_builds_strictly_with_the_cli_and_api_reference(tmp_path):
    pytest.importorskip(
        "mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (scripts/setup.sh test does)"
    )
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # the command-line page is generated from the parser as it is now: every subcommand and option is on it
    from lazyrag.cli import build_parser

    cli = (site / "reference" / "cli" / "index.html").read_text()
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    for name, sub in subcommands.items():
        assert f"lazyrag {name}" in cli
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in cli, f"lazyrag {name} {flag} is not on the generated CLI page"
    engine = (site / "reference" / "engine" / "index.html").read_text()
    for name in ("LazyEngine", "from_pretrained", "SamplingParams", "EngineConfig"):
        assert name in engine
    assert "LazyLlamaLLM" in (site / "reference" / "integrations" / "index.html").read_text()
    server = (site / "reference" / "server" / "index.html").read_text()
    assert 'id="lazyrag.server.build_app"' in server and 'id="lazyrag.server.init_app_state"' in server
    assert (site / "assets" / "results" / "serving_h200.png").is_file()  # plots served from benchmarks/results
