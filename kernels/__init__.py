"""Attention kernels with deferred RoPE (Triton) and their PyTorch reference."""

if __name__ == "kernels":
    # This folder is ``lazyrag.kernels`` (setup.py mounts it); it is found as a top-level ``kernels`` only when the
    # repository root is on sys.path (python -m or pytest from a clone). That name belongs to Hugging Face's
    # ``kernels`` package, which transformers >= 5.25 imports: hand the import over to it.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        # absent. transformers 5.24 probes a 'kernels' it finds by importing it, catches no ImportError there, and
        # counts a module without __file__ or __version__ as not installed: leave exactly such an empty module
        import types

        sys.modules["kernels"] = types.ModuleType("kernels", "no top-level 'kernels' package is installed here")
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds once this file has run
        _spec.loader.exec_module(_module)
