"""The module import graph points one way: each layer imports only from layers below it (or its own),
and no modules import each other in a cycle. The code map in docs/design.md draws the same layers."""

import ast
from pathlib import Path

from tests.helpers import HANG_S

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (pyproject's package-dir): kernels/ and integrations/ install as lazyrag.*
PACKAGE_DIRS = {
    "lazyrag": ROOT / "lazyrag",
    "lazyrag.kernels": ROOT / "kernels",
    "lazyrag.integrations": ROOT / "integrations",
}

# lowest first; a module may import its own layer's modules and anything below
LAYERS = [
    (
        "lazyrag.kernels",
        "lazyrag.kv",
        "lazyrag.prompt",
        "lazyrag.strategy_names",
        "lazyrag.defaults",
        "lazyrag.sizes",
        "lazyrag.extras",
        "lazyrag.version",
    ),  # kernels, KV bookkeeping, prompts, names
    (
        "lazyrag.model",
        "lazyrag.store.corpus",
        "lazyrag.tune.adapter",
    ),  # the Llama model, a LoRA merged into it; a store as a KV tier
    ("lazyrag.engine",),  # the request path
    (
        "lazyrag.store",
        "lazyrag.integrations",
        "lazyrag.eval",
        "lazyrag.demo",
        "lazyrag.server",
        "lazyrag.tune",
    ),  # built on the engine
    ("lazyrag.cli", "lazyrag.__init__", "lazyrag.__main__"),  # the package's front door re-exports the public API
]


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "lazyrag" and parts and parts[0] in ("kernels", "integrations"):
                continue
            found[name] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """lazyrag modules ``path`` imports, at module level or inside functions."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def layer(name: str) -> int:
    name = "lazyrag.__init__" if name == "lazyrag" else name
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS (and the code map in docs/design.md)"
    return rank


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, deps in graph().items()
        for b in deps
        if layer(b) > layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_kv_is_bookkeeping_only():
    for name, deps in graph().items():
        if name.startswith("lazyrag.kv"):
            assert all(d.startswith("lazyrag.kv") or d == "lazyrag" for d in deps), (name, deps)


# top-level names of the repository's folders that are not shipped: product code must never import them
NOT_SHIPPED = {"benchmarks", "tests", "scripts", "examples", "shared"}


def foreign_imports(source: str) -> list[str]:
    """Modules ``source`` imports (absolute, at any depth) whose top-level name is a folder that is not shipped,
    or that load a file by path (importlib's spec_from_file_location: how a benchmark or lab script is reached)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "spec_from_file_location"
        ):
            names = ["<spec_from_file_location>"]
        else:
            continue
        out += [n for n in names if n.split(".")[0] in NOT_SHIPPED or n.startswith("<")]
    return out


def test_product_code_imports_no_benchmark_test_or_lab_code():
    """lazyrag/, kernels/ and integrations/ (what the wheel ships) import nothing from benchmarks/, tests/,
    scripts/ or examples/, nor load a module from a file path."""
    found = [
        f"{name}: {', '.join(bad)}" for name, path in modules().items() if (bad := foreign_imports(path.read_text()))
    ]
    assert not found, "\n".join(found)


def test_the_foreign_import_check_can_fail():
    assert foreign_imports("import benchmarks.routing") == ["benchmarks.routing"]
    assert foreign_imports("def f():\n    from tests.helpers import CHUNKS") == ["tests.helpers"]
    assert foreign_imports("import importlib.util as u\nu.spec_from_file_location('x', 'benchmarks/x.py')") == [
        "<spec_from_file_location>"
    ]
    assert foreign_imports("from . import common\nimport torch\nfrom lazyrag.kv import cache") == []


def test_kernels_import_only_kernels_torch_and_triton():
    """kernels/ is the bottom layer: it imports no other lazyrag module (the engine selects kernels, not the
    reverse)."""
    for name, deps in graph().items():
        if name.startswith("lazyrag.kernels"):
            assert all(d.startswith("lazyrag.kernels") for d in deps), (name, deps)


def test_no_import_cycles():
    g = {a: {b for b in deps if b != "lazyrag"} for a, deps in graph().items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in g.get(n, ()):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in g:
        if n not in state:
            visit(n)


def test_the_source_trees_kernels_folder_never_shadows_a_top_level_kernels():
    """From a clone's root (cwd on sys.path) the folder kernels/ is importable as ``kernels``, the name of Hugging
    Face's package that transformers >= 5.25 imports. It hands that import over (or, with none installed, leaves
    an empty module that transformers' probe reads as absent) and serves only as ``lazyrag.kernels``; transformers'
    model code imports from the root either way."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    probe = (
        "import sys, lazyrag.kernels as ours\n"
        "import transformers.activations\n"  # probes 'kernels' (5.24 by importing what it finds)
        "try:\n    import kernels\nexcept ImportError:\n    print('absent')\n"
        "else:\n    f = getattr(kernels, '__file__', None)\n"
        "    print('absent' if f is None else 'shadowed' if kernels is ours or f == ours.__file__ else 'theirs')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("absent", "theirs")


SERVER_FUNCTION_LINES = 80  # the most lines a function of lazyrag/server/ may take (issue 45: routes over app.state)


def long_functions(source: str, limit: int = SERVER_FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of each function or method in ``source`` longer than ``limit`` lines, nested ones too."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_server_is_small_functions_and_create_app_is_gone():
    """lazyrag/server/ is routes over ``app.state`` (vLLM's ``build_app`` / ``init_app_state``): no function over
    80 lines, and no ``create_app``, the one function that held the whole app in closures."""
    folder = ROOT / "lazyrag" / "server"
    found = [f"{p.name}: {f}" for p in sorted(folder.glob("*.py")) for f in long_functions(p.read_text())]
    assert not found, "\n".join(found)
    defined = {
        f"{p.name}: {node.name}"
        for p in folder.glob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == "create_app"
    }
    assert not defined, defined
    import lazyrag.server

    assert not hasattr(lazyrag.server, "create_app") and callable(lazyrag.server.build_app)


def test_the_function_length_check_can_fail():
    long_one = "def f():\n" + "    x = 1\n" * 80
    assert long_functions(long_one) == ["f (81 lines, line 1)"]
    assert long_functions("async def g():\n    pass\n") == []
    assert long_functions("class C:\n    def m(self):\n" + "        y = 2\n" * 80) == ["m (81 lines, line 2)"]
