"""Structured output for a chat model without constrained decoding: the JSON schema goes into the
prompt, the first JSON object of the answer is parsed and validated with Pydantic, and a failed
attempt is retried with the error shown to the model. An answer with no JSON object at all (not even
a ``{``) means the model does not follow the instructions: that fails at once, with no retry."""

from __future__ import annotations

import json
from typing import Any, Optional

from lazyrag.extras import require

require("lazyrag's structured output", "langchain_core", "pydantic")

from langchain_core.exceptions import OutputParserException  # noqa: E402 (after the check)
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, convert_to_messages
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import TypeAdapter, ValidationError


def _as_messages(input: LanguageModelInput) -> list[BaseMessage]:
    """A chat model's input (a prompt value, a string or messages) as its messages, as the chat model reads it."""
    if isinstance(input, PromptValue):
        return input.to_messages()
    if isinstance(input, str):
        return [HumanMessage(input)]
    return convert_to_messages(input)


class NoJSONObject(ValueError):
    """The answer holds no JSON object."""


def first_json_object(text: str) -> Any:
    """The first JSON object in ``text`` (prose or a ```json fence around it is ignored)."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    raise NoJSONObject("the answer holds no JSON object")


class StructuredOutput:
    """The prompt, parse, validate and retry loop around one chat model and one schema."""

    def __init__(self, llm, schema: Any, include_raw: bool = False, max_attempts: int = 3):
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1.")
        self.llm, self.schema, self.include_raw, self.max_attempts = llm, schema, include_raw, max_attempts
        self.json_schema = convert_to_json_schema(schema)  # ValueError for what is not a schema
        is_dict_schema = isinstance(schema, dict)
        # Pydantic validates models and TypedDicts; a raw JSON-schema dict is checked for its required keys
        self._adapter = None if is_dict_schema else TypeAdapter(schema)
        self._required = list(self.json_schema.get("required", [])) if is_dict_schema else []

    def instructions(self) -> str:
        # Small models copy a schema back; a skeleton of the keys and their types they fill in. The full
        # schema is given only when a field is more than a plain value.
        props = self.json_schema.get("properties", {})
        plain = props and all(p.get("type") in ("string", "integer", "number", "boolean") for p in props.values())
        if plain:
            keys = ", ".join(f'"{k}": <{p["type"]}>' for k, p in props.items())
            return f"Reply with only this JSON object filled in, no other text: {{{keys}}}"
        return "Reply with only a JSON object, no other text, that conforms to this JSON schema:\n" + json.dumps(
            self.json_schema
        )

    def validate(self, text: str) -> Any:
        obj = first_json_object(text)
        if self._adapter is not None:
            return self._adapter.validate_python(obj)
        missing = [k for k in self._required if k not in obj]
        if missing:
            raise ValueError(f"the JSON object lacks the required key(s) {', '.join(missing)}")
        return obj

    def messages(self, input: LanguageModelInput) -> list[BaseMessage]:
        """The input's messages with the instructions after the last one (where small models heed them)."""
        messages = _as_messages(input)
        if messages and isinstance(messages[-1], HumanMessage):
            return [*messages[:-1], HumanMessage(f"{messages[-1].text}\n\n{self.instructions()}")]
        return [*messages, HumanMessage(self.instructions())]

    @staticmethod
    def _retry(messages: list[BaseMessage], answer: AIMessage, error: Exception) -> list[BaseMessage]:
        return [
            *messages,
            AIMessage(answer.text),
            HumanMessage(f"That answer is not valid: {error}. Reply with only the corrected JSON object."),
        ]

    def _outcome(self, answer: AIMessage, parsed: Any, error: Optional[Exception]) -> Any:
        if self.include_raw:
            return {"raw": answer, "parsed": parsed, "parsing_error": error}
        if error is not None:
            raise error
        return parsed

    def _failure(self, answer: AIMessage, error: Exception) -> OutputParserException:
        return OutputParserException(
            f"ChatLazyLlama gave no JSON matching the schema in {self.max_attempts} attempt(s); last error: {error}. "
            "Try a larger model, a simpler schema, a higher max_tokens, or more max_attempts.",
            llm_output=answer.text,
        )

    def _not_following(self, answer: AIMessage, attempt: int) -> OutputParserException:
        snippet = answer.text.strip().replace("\n", " ")
        snippet = snippet[:120] + ("..." if len(snippet) > 120 else "")
        return OutputParserException(
            f"ChatLazyLlama's answer holds no JSON object at all ({snippet!r}), so the model is not following the "
            f"schema instructions; not retried (attempt {attempt + 1} of {self.max_attempts}). Small models such as "
            "the embedded 135M one often cannot: use a larger instruction-tuned model (model=...), a simpler schema, "
            "or plain text output.",
            llm_output=answer.text,
        )

    def _check(self, answer: AIMessage, messages: list[BaseMessage], attempt: int) -> tuple[Optional[tuple], list]:
        """``((outcome,), messages)`` when done, else ``(None, messages for the retry)``. Fails fast, without
        retries, on an answer with no ``{`` at all: a model that ignores the format would only do so again."""
        try:
            return (self._outcome(answer, self.validate(answer.text), None),), messages
        except (ValueError, ValidationError) as e:
            if isinstance(e, NoJSONObject) and "{" not in answer.text:
                return (self._outcome(answer, None, self._not_following(answer, attempt)),), messages
            if attempt + 1 < self.max_attempts:
                return None, self._retry(messages, answer, e)
            return (self._outcome(answer, None, self._failure(answer, e)),), messages

    def invoke(self, input: LanguageModelInput, config: Optional[RunnableConfig] = None) -> Any:
        messages, done = self.messages(input), None
        for attempt in range(self.max_attempts):
            done, messages = self._check(self.llm.invoke(messages, config), messages, attempt)
            if done:
                return done[0]

    async def ainvoke(self, input: LanguageModelInput, config: Optional[RunnableConfig] = None) -> Any:
        messages, done = self.messages(input), None
        for attempt in range(self.max_attempts):
            done, messages = self._check(await self.llm.ainvoke(messages, config), messages, attempt)
            if done:
                return done[0]

    def runnable(self) -> Runnable:
        name = getattr(self.schema, "__name__", None) or self.json_schema.get("title", "schema")
        return RunnableLambda(self.invoke, afunc=self.ainvoke, name=f"ChatLazyLlamaStructuredOutput[{name}]")
