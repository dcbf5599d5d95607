"""What the LlamaIndex LLM and the LangChain chat model share as pydantic: ``AdapterFields``, a base model both
inherit next to their framework's (``class LazyLlamaLLM(AdapterFields, CustomLLM)``, ``class
ChatLazyLlama(AdapterFields, BaseChatModel)``), in the style of llama-index-llms-huggingface and
langchain-huggingface: the public configuration in pydantic fields, checked before any model loads; the heavy
engine in a private attribute, loaded on first use.

It holds the fields both take under the same name (model, device, dtype, the sampling knobs, strategy, store,
kv_budget), the constructor checks, the lazy ``engine`` and the SamplingParams a call gets. Each adapter keeps
what its framework names or types its own way: ``max_tokens`` / ``max_new_tokens``, ``stop``, ``logprobs`` (where
they are reported), and its ``_renames`` (the names users bring from that framework's Hugging Face adapter).

pydantic, not torch: importing this loads no model. (``_common`` stays free of pydantic: ``lazyrag.get_engine``
uses it without the extras.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from lazyrag.defaults import MIN_TEMPERATURE
from lazyrag.integrations import _common
from lazyrag.strategy_names import check_strategy

if TYPE_CHECKING:
    from lazyrag.engine import LazyEngine, SamplingParams

_LIMITS = _common.SAMPLING_LIMITS


def limited_field(limits: str, **kwargs: Any) -> Any:
    """``Field(**kwargs)`` with the constraints ``_common.SAMPLING_LIMITS[limits]`` (ge, le, allow_inf_nan, ...):
    the limits stay in one table, which SamplingParams' checks match. Returns ``Any`` as ``Field`` does (a field's
    default to mypy): mypy reads a pydantic field from ``Field(...)`` written out and cannot check a ``**`` spread."""
    return Field(**kwargs, **_LIMITS[limits])


# the adapters' fields that go into SamplingParams as they are, a call's keyword winning over the field
_KNOBS = (
    "temperature",
    "top_p",
    "seed",
    "strategy",
    "top_k",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class AdapterFields(BaseModel):
    """The fields, checks and lazy engine of both adapters (see the module's docstring). An adapter lists it
    first among its bases and sets ``_renames``; ``model_config`` (``extra="forbid"``) stays the adapter's."""

    # names users bring from other local-model adapters -> ours (an adapter's own; generate_kwargs' keys too)
    _renames: ClassVar[dict[str, str]] = {}

    model: Optional[str] = Field(
        default=None, description="Local Llama folder or .gguf file; None = the embedded SmolLM2-135M-Instruct."
    )
    device: Optional[str] = Field(default=None, description="cpu or cuda (default: cuda if available).")
    dtype: Optional[str] = Field(
        default=None, description="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA)."
    )
    temperature: float = limited_field("temperature", default=0.0, description="0 = greedy, else at least 1e-5.")
    top_p: float = limited_field("top_p", default=1.0)
    seed: Optional[int] = limited_field(
        "seed", default=None, description="Sampling seed (temperature > 0), in [0, 2**63)."
    )
    top_k: int = limited_field(
        "sampling_top_k", default=-1, description="Sample from the k most likely tokens; -1 or 0 = all."
    )
    repetition_penalty: float = limited_field(
        "repetition_penalty",
        default=1.0,
        description="HF / vLLM repetition penalty over prompt and answer tokens; 1 = off.",
    )
    presence_penalty: float = limited_field(
        "penalty", default=0.0, description="OpenAI's presence penalty, in [-2, 2]."
    )
    frequency_penalty: float = limited_field(
        "penalty", default=0.0, description="OpenAI's frequency penalty, in [-2, 2]."
    )
    top_logprobs: Optional[int] = limited_field(
        "top_logprobs", default=None, description="With logprobs: also the n most likely tokens per position (0-20)."
    )
    strategy: str = Field(
        default="lazy",
        description="full, prefix, position_aware, lazy, lazy+recover (lazy with quality recovery, ~15% of chunk "
        "tokens recomputed), lazy:first=K or lazy:blend=R[:select=attn_dev] (see the docs' engine page).",
    )
    store: Optional[str] = Field(
        default=None, description="A corpus store folder (lazyrag precache) to serve chunk KV from."
    )
    kv_budget: Optional[int] = limited_field(
        "positive", default=None, description="Bytes of KV pool, when this model loads the shared engine."
    )

    _engine: Any = PrivateAttr(default=None)

    if TYPE_CHECKING:  # each adapter's own field: its description says where the logprobs are reported
        logprobs: Optional[bool]

    def __init__(self, engine=None, **kwargs: Any) -> None:
        """``engine``: an already-loaded LazyEngine to use instead of the shared one for ``model``."""
        super().__init__(**kwargs)
        self._engine = engine
        if engine is not None:
            self._setup(engine)

    def model_post_init(self, context: Any, /) -> None:
        # Defined to chain: pydantic gives a model with private attributes a model_post_init of its own, which
        # would hide the framework's (LangChain's seeds metadata["lc_versions"]) behind this base.
        super().model_post_init(context)

    # -- checked before any model loads (the other numbers by the fields' own constraints) --

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, data: Any) -> Any:
        return _common.init_kwargs(cls, data, cls._renames)

    @field_validator("strategy")
    @classmethod
    def _strategy_exists(cls, name: str) -> str:
        return check_strategy(name)

    @field_validator("temperature")
    @classmethod
    def _temperature_usable(cls, t: float) -> float:
        """0 or at least MIN_TEMPERATURE, as SamplingParams takes."""
        if t != 0 and t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}; got {t!r}")
        return t

    # -- the engine --

    @property
    def engine(self) -> LazyEngine:
        """The LazyEngine, loaded on first use and shared with every adapter on the same model."""
        if self._engine is None:
            self._engine = _common.shared_engine(self.model, self.device, self.dtype, self.kv_budget)
            self._setup(self._engine)
        return self._engine

    def _setup(self, engine: LazyEngine) -> None:
        """An engine this adapter will use: the store attached, retrieved chunks registered in it."""
        _common.attach_store_once(engine, self.store)
        _common.learn_into(engine)  # what any retriever returns becomes reusable chunks

    def _sampling_params(self, max_new_tokens: int, stop: list[str], kwargs: dict) -> SamplingParams:
        """A call's SamplingParams: its keywords (``kwargs``) win over the fields; ``logprobs=True`` (ChatOpenAI's
        name) asks for the chosen token's logprob and the ``top_logprobs`` best ones."""
        from lazyrag.engine import SamplingParams

        logprobs = kwargs.get("logprobs", self.logprobs)
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            stop=tuple(stop),
            logprobs=int(kwargs.get("top_logprobs", self.top_logprobs) or 0) if logprobs else None,
            **{k: kwargs.get(k, getattr(self, k)) for k in _KNOBS},
        )
