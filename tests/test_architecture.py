"""The module import graph points one way: each layer imports only from layers below it (or its own),
and no modules import each other in a cycle. The code map in docs/design.md draws the same layers."""

import ast
from pathlib import Path

from tests.helpers import HANG_S

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (setup.py's package_dir): integrations/ installs as lazyrag.integrations
PACKAGE_DIRS = {
    "lazyrag": ROOT / "lazyrag",
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
            if pkg == "lazyrag" and parts and parts[0] == "integrations":
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
    """lazyrag/ and integrations/ (what the wheel ships) import nothing from benchmarks/, tests/,
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
    """lazyrag/kernels/ is the bottom layer: it imports no other lazyrag module (the engine selects kernels, not the
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


def test_the_source_tree_never_shadows_a_top_level_kernels():
    """From a clone's root (cwd on sys.path) nothing of the tree is importable as ``kernels``, the name of Hugging
    Face's package that transformers >= 5.25 imports: the kernels live in ``lazyrag/kernels/``, so ``import
    kernels`` finds Hugging Face's package or nothing, and transformers' probe of it reads the truth."""
    import subprocess
    import sys

    probe = (
        "import os, lazyrag.kernels\n"
        "import transformers.activations\n"  # probes 'kernels' (5.24 by importing what it finds)
        "try:\n    import kernels\nexcept ImportError:\n    print('absent')\n"
        "else:\n    f = getattr(kernels, '__file__', None)\n"
        # the root's kernels/__init__.py or kernels.py (a .venv inside the clone holds Hugging Face's, deeper down)
        "    d = f and os.path.dirname(os.path.abspath(f))\n"
        "    print('absent' if f is None else 'shadowed' if os.getcwd() in (d, os.path.dirname(d)) else 'theirs')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("absent", "theirs")


FUNCTION_LINES = 80  # the most lines a product function may take (issue 45), @triton.jit / @gluon.jit kernels aside
# (file, function) -> why it is longer still, until a change with its own GPU check splits it
LONG_FUNCTIONS_ALLOWED = {
    ("lazyrag/kernels/prefill.py", "plan_prefill"): "the prefill kernels' tile-table planner (93 lines) is on "
    "every lazy request's path: splitting it needs the GPU e2e A/B of a kernels change",
}


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0].endswith(".jit") for d in node.decorator_list)


def long_functions(source: str, limit: int = FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of each function or method in ``source`` longer than ``limit`` lines, nested ones too;
    JIT-compiled kernels (``@triton.jit``, ``@gluon.jit``) aside."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
        and not _is_kernel(node)
    ]


def test_no_product_function_is_over_80_lines():
    """Small functions with one job each (issue 45): lazyrag/ (kernels/ included) and integrations/."""
    found = []
    for folder in ("lazyrag", "integrations"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for f in long_functions(path.read_text()):
                if (rel, f.split(" ")[0]) not in LONG_FUNCTIONS_ALLOWED:
                    found.append(f"{rel}: {f}")
    assert not found, "\n".join(found)


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
    assert long_functions("@triton.jit\ndef k():\n" + "    x = 1\n" * 80) == []  # a kernel may be long
    assert long_functions("@functools.cache\ndef c():\n" + "    x = 1\n" * 80) == ["c (81 lines, line 2)"]


# issue 45: the engine's front door holds an engine core and never asks how many processes run it
ENGINE = ROOT / "lazyrag" / "engine"
# (file, access) -> why it stays: the only private names of another module that the product code touches
ARGPARSE = "argparse has no public way to list a parser's actions or subcommands, which the flags checks walk"
PRIVATE_ACCESS_ALLOWED = {
    ("lazyrag/engine/engine.py", "model._apply"): "torch.nn.Module._apply makes a meta model's tensors with "
    "torch.empty in the load dtype in one pass (to_empty imports sympy and keeps a float32 copy); torch has no "
    "public equivalent",
    ("lazyrag/engine/tensor_parallel.py", "os._exit"): "os._exit is public API: a worker whose parent is gone "
    "exits at once, without atexit handlers or joining threads",
    ("integrations/langchain.py", "llm._get_invocation_params"): "the invocation parameters BaseChatModel itself "
    "gives its callbacks' on_chat_model_start, so tracing sees LazyRAG's answer as a ChatLazyLlama run; "
    "langchain-core has no public equivalent",
    **{
        ("lazyrag/cli/common.py", access): ARGPARSE
        for access in (
            "parser._subparsers",
            "parser._subparsers._group_actions",
            "argparse._SubParsersAction",
            "parser._actions",
            "argparse._AppendAction",
        )
    },
}


def foreign_private_accesses(source: str) -> list[str]:
    """``receiver._name (line N)`` for each attribute with one leading underscore, read or written, on a receiver
    other than ``self`` or ``cls``, that the module does not define itself (as a function, method or class, an
    attribute assigned on ``self``/``cls``, or a name assigned in a class body): another module's private name."""
    tree = ast.parse(source)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        if isinstance(node, ast.ClassDef):  # its class attributes
            for stmt in node.body:
                if isinstance(stmt, ast.Assign):
                    own.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    own.add(stmt.target.id)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            own.add(node.attr)
    return [
        f"{ast.unparse(node)} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and node.attr not in own
    ]


def test_no_module_calls_another_modules_private_names():
    """The product's modules meet through public names: tensor parallelism calls the engine core's (no more
    ``engine._encode_locked`` or ``scheduler._fail``), the front door calls the core's, a replica asks the engine
    and its cache through public methods. Each exception has its reason."""
    files = sorted([*(ROOT / "lazyrag").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")])
    found = [
        f"{p.relative_to(ROOT)}: {access}"
        for p in files
        for access in foreign_private_accesses(p.read_text())
        if (str(p.relative_to(ROOT)), access.rpartition(" (line")[0]) not in PRIVATE_ACCESS_ALLOWED
    ]
    assert not found, "\n".join(found)


# benchmarks time or count the engine's insides; each reach past its public names has its reason
RUNNER_TIMING = "stamps when the runner builds a batch: e2e_gpu's TTFT timeline (planning, batch, launch, replay)"
BENCHMARK_PRIVATE_ALLOWED = {
    ("benchmarks/e2e_gpu.py", "runner._batch"): RUNNER_TIMING,
    ("benchmarks/recovery_proxy.py", "runner._batch"): "builds one sequence's batch to read the hidden states of "
    "its forward, which no public call returns",
    ("benchmarks/recovery_proxy.py", "runner._runtime"): "the same forward's runtime metadata",
    ("benchmarks/recover_ops.py", "blend._kernel_checked"): "counts the recovery's ops with the kernels' "
    "first-use check switched off on the CPU",
    ("benchmarks/recover_ops.py", "torch.utils._pytree"): "torch's dispatch-mode op counter walks arguments with "
    "its own pytree, which torch does not export publicly",
    ("benchmarks/recover_ops.py", "func._schema"): "an op's schema tells a view from a copy; torch has no public "
    "accessor on OpOverload",
    ("benchmarks/recover_ops.py", "sys._getframe"): "sys._getframe is public API: the counter keeps only the ops "
    "that lazyrag's own files call",
}


def test_benchmarks_use_the_public_names_or_say_why_not():
    """A benchmark that reaches a private name breaks silently when it is renamed; public equivalents exist for
    what they need (``cache.cached_blocks``, ``engine.step``, ``scheduler.end_tokens``, ``host.held_tokens``...)."""
    found = [
        f"{p.relative_to(ROOT)}: {access}"
        for p in sorted((ROOT / "benchmarks").glob("*.py"))
        for access in foreign_private_accesses(p.read_text())
        if (str(p.relative_to(ROOT)), access.rpartition(" (line")[0]) not in BENCHMARK_PRIVATE_ALLOWED
    ]
    assert not found, "\n".join(found)


def test_the_private_access_check_can_fail():
    assert foreign_private_accesses("def f(s):\n    s._fail(1)\n") == ["s._fail (line 2)"]
    assert foreign_private_accesses("def f(e):\n    e.scheduler._launched = None\n") == [
        "e.scheduler._launched (line 2)"
    ]
    mine = "class A:\n    _n = 0\n    def __init__(self):\n        self._x = 1\n    def _m(self):\n        pass\n"
    assert foreign_private_accesses(mine + "def g(a):\n    return a._x, a._m(), A._n\n") == []
    assert foreign_private_accesses("def f(self, o):\n    self._y()\n    return o.__len__()\n") == []


def test_the_front_door_never_asks_how_many_processes_run_it():
    """engine.py's ``LazyEngine`` calls its core (an ``EngineCore``, or rank 0's ``TensorParallelCore``); tensor
    parallelism's wire is calls of the core's methods by name (no ``run_op`` switch)."""
    assert "tp_driver" not in (ENGINE / "engine.py").read_text()
    for p in (ROOT / "lazyrag").rglob("*.py"):
        assert "run_op" not in p.read_text(), p
    from lazyrag.engine import tensor_parallel
    from lazyrag.engine.core import EngineCore

    assert not hasattr(tensor_parallel, "run_op")
    shared = ("add", "abort", "drop_aborted", "step", "has_work", "encode", "attach", "chunk_key", "identity")
    for name in shared:
        assert callable(getattr(EngineCore, name)) and callable(getattr(tensor_parallel.TensorParallelCore, name))
