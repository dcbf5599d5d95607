"""The OpenAI wire format that ``lazyrag serve`` speaks: request bodies (validated by pydantic, so a
malformed one is a 422 before anything runs), the extra fields lazyrag adds, and the response bodies."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lazyrag.defaults import MAX_K, MAX_LOGPROBS, MIN_REPETITION_PENALTY
from lazyrag.strategy_names import check_strategy


class Document(BaseModel):
    """A chunk of context given with the request (lazyrag's ``documents`` field): its KV is reused."""

    model_config = ConfigDict(extra="ignore")
    text: str = Field(min_length=1)


class _Common(BaseModel):
    """Fields both endpoints take. Unknown fields are ignored (as vLLM does); fields lazyrag cannot
    honour are refused when set to anything but their no-op value (``unsupported``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=100, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    # vLLM's extra sampling fields
    top_k: int | None = Field(default=None, ge=-1, description="keep the k most likely tokens; -1 or 0 = all")
    repetition_penalty: float | None = Field(
        default=None,
        ge=MIN_REPETITION_PENALTY,
        le=100,
        allow_inf_nan=False,
        description="HF / vLLM repetition penalty over prompt and answer tokens; 1 = off",
    )
    ignore_eos: bool | None = Field(
        default=None, description="keep generating past end-of-turn tokens up to max_tokens"
    )
    # no-op unless set: refused with a clear message otherwise
    logit_bias: dict | None = None
    # lazyrag's own
    documents: list[str | Document] | None = Field(
        default=None, description="chunks of context whose KV is cached and reused at any position"
    )
    strategy: str | None = Field(
        default=None, description="how the prompt's KV is obtained: lazy, lazy+recover, full, ..."
    )
    k: int | None = Field(default=None, ge=1, le=MAX_K, description="chunks to retrieve from the attached store")
    retrieve: bool | None = Field(
        default=None, description="retrieve from the attached store (chat: when no chunk is given or found)"
    )

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, name):
        return None if name is None else check_strategy(name)

    def document_texts(self) -> list[str] | None:
        if self.documents is None:
            return None
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def unsupported(self) -> list[str]:
        """The fields set to something lazyrag does not do (yet): refused, never silently dropped."""
        bad = []
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or how many top logprobs per token (the chosen token's always)."""
        return None

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused (this server reads text only)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"message content part of type {part.get('type')!r} is not supported: send text parts only."
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools (this server does no tool calling)")
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            bad.append("response_format other than text")
        return bad


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="top logprobs per token (0: the chosen token's only)"
    )

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.suffix:
            bad.append("suffix")
        if self.best_of not in (None, 1):
            bad.append("best_of")
        return bad


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: ``prompt`` (a completion's text) or ``messages`` (through the chat template)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant turn's opening, as a chat request does
    add_special_tokens: bool | None = None  # None: True for a prompt (BOS where the model has one), False for messages
    return_token_strs: bool = False  # also each token's string

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt (a text) or messages (chat messages)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object. ``cached_tokens``: prompt tokens whose KV was already cached (chunks read
    from the cache or a store, and the shared prompt prefix); they were not computed for this request."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(
    message: str, type_: str = "invalid_request_error", code: int | str | None = None, param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
