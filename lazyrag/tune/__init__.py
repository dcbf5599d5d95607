"""``lazyrag tune``: adapt a model to read position-free chunk KV (``lazy``) as it reads a full prefill."""

from lazyrag.tune.train import TuneConfig, TuneResult, tune

__all__ = ["TuneConfig", "TuneResult", "tune"]
