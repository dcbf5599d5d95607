"""Run by scripts/check_wheel.sh inside a fresh venv holding only the built wheel: the package is the
installed one, it has every module of the source tree, each imports, and the embedded model answers."""
import importlib
import pkgutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(sys.argv[1])  # the source tree, read as a list of files only: never put on sys.path
MOUNTED = {"lazyrag": "lazyrag", "lazyrag.integrations": "integrations"}


def source_modules() -> set[str]:
    found = set()
    for package, folder in MOUNTED.items():
        for path in (SOURCE / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(SOURCE / folder).with_suffix("").parts if p != "__init__"]
            found.add(".".join([package, *parts]))
    return found


import lazyrag  # noqa: E402

site = Path(sysconfig.get_paths()["purelib"]).resolve()
assert Path(lazyrag.__file__).resolve().is_relative_to(site), f"lazyrag imported from {lazyrag.__file__}, not {site}"
# the wheel's own files (its RECORD): none outside lazyrag/ (Hugging Face's "kernels", a transformers dependency,
# may be installed beside it under that generic name, so the check is on what this wheel put there)
from importlib.metadata import distribution  # noqa: E402

tops = {Path(str(f)).parts[0] for f in distribution("lazyrag").files or []}  # ".." for the console scripts in bin/
extra = {t for t in tops if t not in ("lazyrag", "..") and not t.endswith(".dist-info")}
assert not extra, f"the wheel installed top-level names besides lazyrag: {sorted(extra)}"

installed = {"lazyrag"} | {m.name for m in pkgutil.walk_packages(lazyrag.__path__, "lazyrag.")}
missing = source_modules() - installed
assert not missing, f"modules in the source tree but not in the wheel: {sorted(missing)}"
for name in sorted(installed):
    importlib.import_module(name)
print(f"imported {len(installed)} modules from {site}")
assert (Path(lazyrag.__file__).parent / "data" / "demo_corpus.json").is_file(), "package data missing"
assert (Path(lazyrag.__file__).parent / "kernels" / "tuned_configs.json").is_file(), "kernels/tuned_configs.json missing"
from lazyrag.tune.adapter import EMBEDDED_FOLDER  # noqa: E402

assert {"adapter_config.json", "adapter_model.safetensors", "lazyrag_tune.json"} <= {p.name for p in EMBEDDED_FOLDER.iterdir()}, \
    "the embedded adapter is missing from the wheel"
dist = distribution("lazyrag")
assert dist.version == lazyrag.__version__, f"metadata version {dist.version} != lazyrag.__version__ {lazyrag.__version__}"
assert (Path(lazyrag.__file__).parent / "py.typed").is_file(), "py.typed missing: type checkers would treat lazyrag as untyped"
assert any(Path(str(f)).name == "LICENSE" for f in dist.files or []), "the LICENSE file is not in the wheel"
assert any(r.replace(" ", "").startswith("lazyrag[retrieval];") and "llama-index" in r for r in dist.requires or []), \
    f"the llama-index extra does not bring retrieval: {dist.requires}"

from lazyrag import LazyEngine  # noqa: E402

engine = LazyEngine.from_pretrained()
chunks = ["Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital in London.",
          "Tea became popular in Britain after 1662."]
engine.precache(chunks)
r = engine.generate("Who discovered penicillin?", chunks[::-1], max_new_tokens=16)
print(f"answer: {r.text!r} (chunks hit {r.stats.chunks_hit})")
assert "fleming" in r.text.lower() and r.stats.chunks_hit == 2, r

out = subprocess.run([sys.executable, "-m", "lazyrag", "--help"], capture_output=True, text=True, check=True).stdout
assert "lazyrag demo" in out and "serve" in out, out
