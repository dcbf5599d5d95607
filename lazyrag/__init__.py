"""lazyrag: RAG with reusable, position-free KV caches.

Each retrieved chunk's KV cache is computed once, stored once, and reused at any position
of any prompt; the positional rotation (RoPE) for its actual place is applied lazily inside
the attention kernels.
"""
import os as _os

# The top-level folders kernels/ and integrations/ install as lazyrag.kernels and
# lazyrag.integrations (pyproject's package-dir). In a source tree used without installing
# (e.g. PYTHONPATH=. on a GPU box), find them beside this package instead.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
    __path__.append(_root)  # type: ignore[name-defined]

__version__ = "0.1.0"


def __getattr__(name):
    # `from lazyrag import LazyEngine` without importing torch at `import lazyrag` time
    if name == "LazyEngine":
        from lazyrag.engine import LazyEngine

        return LazyEngine
    raise AttributeError(name)
