"""OpenAI's response_format and tool-calling bodies, and vLLM's guided_* extras, as pydantic
models; ``structured_outputs_of`` turns a request's choice into StructuredOutputsParams."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from kvserve.sampling_params import StructuredOutputsParams


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class JsonSchemaResponseFormat(_Model):
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute: stored as json_schema, spoken as "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    # vLLM's structural_tag form: {"structures": [...], "triggers": [...]} at the top level.
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsRequestFields(_Model):
    """Mixed into the completion and chat requests: every way to ask for a constraint."""

    response_format: ResponseFormat | None = None
    # vLLM's form: the fields of StructuredOutputsParams.
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older guided_* extras.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint; ValueError (a 400) when it asks for two or a bad one."""
        asked: list[StructuredOutputsParams] = []
        if self.structured_outputs is not None:
            # The backend is the server's choice, not a field clients set.
            fields = {k: v for k, v in self.structured_outputs.items() if not k.startswith("_")}
            try:
                asked.append(msgspec.convert(fields, StructuredOutputsParams))
            except msgspec.ValidationError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if any(
            v is not None
            for v in (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        ):
            asked.append(
                StructuredOutputsParams(
                    json=self.guided_json,
                    regex=self.guided_regex,
                    choice=self.guided_choice,
                    grammar=self.guided_grammar,
                    whitespace_pattern=self.guided_whitespace_pattern,
                )
            )
        from_format = _from_response_format(self.response_format)
        if from_format is not None:
            asked.append(from_format)
        if len(asked) > 1:
            raise ValueError(
                "structured_outputs: give one of response_format, structured_outputs and "
                "guided_*, not several"
            )
        return asked[0] if asked else None


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "structural_tag":
        tag = {"structures": fmt.structures or [], "triggers": fmt.triggers or []}
        return StructuredOutputsParams(structural_tag=json.dumps(tag))
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ValueError("response_format: type json_schema needs json_schema.schema")
    # strict: OpenAI's rule that objects take no properties beyond the schema's.
    return StructuredOutputsParams(
        json=fmt.json_schema.json_schema,
        disable_additional_properties=bool(fmt.json_schema.strict),
    )


# ---------------------------------------------------------------- tools


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Model):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}
