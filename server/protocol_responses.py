"""Pydantic models of OpenAI's Responses API (`POST /v1/responses`): input items, function tools,
text formats. Strict like the chat models: unknown fields and unimplemented features are 400s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator

from server.protocol import (
    CacheSalt,
    Metadata,
    NonNegInt,
    OpenModel,
    PartError,
    ReasoningEffort,
    StrictModel,
    typed_union,
)


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """An assistant's earlier output, sent back as input (as clients replay `response.output`)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


if TYPE_CHECKING:
    ContentPart = InputText | OutputText | Refusal
else:
    ContentPart = typed_union(
        {"input_text": InputText, "output_text": OutputText, "refusal": Refusal}
    )


def _text_parts_only(value: Any) -> Any:
    """Name the real problem (an image or file part) instead of the union's type mismatch."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_file", "input_audio"):
                raise PartError(i, kind)
    return value


class MessageItem(StrictModel):
    """A message: `{"role", "content"}` (type optional), with string or text-part content."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _check_parts = field_validator("content", mode="before")(_text_parts_only)


class FunctionCallItem(StrictModel):
    """A function call the model made earlier, replayed as history."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The caller's result of a function call, matched to it by `call_id`."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _check_parts = field_validator("output", mode="before")(_text_parts_only)


class ReasoningItem(StrictModel):
    """A reasoning item of an earlier response, passed back as history: accepted and left out of
    the prompt (chat templates drop the reasoning of earlier turns)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


if TYPE_CHECKING:
    InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
else:
    InputItem = typed_union(
        {
            "reasoning": ReasoningItem,
            "message": MessageItem,
            "function_call": FunctionCallItem,
            "function_call_output": FunctionCallOutputItem,
        },
        default="message",
    )


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class FormatText(StrictModel):
    type: Literal["text"]


class FormatJsonObject(StrictModel):
    type: Literal["json_object"]


class FormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    description: str | None = None
    strict: bool | None = None


if TYPE_CHECKING:
    TextFormat = FormatText | FormatJsonObject | FormatJsonSchema
else:
    TextFormat = typed_union(
        {"text": FormatText, "json_object": FormatJsonObject, "json_schema": FormatJsonSchema}
    )


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a plain model has


class ReasoningConfig(StrictModel):
    """`reasoning`: the effort goes to the chat template as `reasoning_effort`; a summary is accepted
    but none is made (the reasoning item carries the reasoning text itself)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # nothing is obfuscated here; accepted either way


class ResponsesRequest(StrictModel):
    model: str | None = None
    # kvserve: add the per-request cost sheet (`metrics`); null defers to the X-KVServe-Metrics header.
    return_metrics: bool | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    prompt_cache_key: str | None = None  # a routing hint; prefix caching is automatic here
    safety_identifier: str | None = None
    # Extensions (vLLM names), passed on to sampling like chat completions' fields.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    seed: int | None = None  # its range is the engine's rule (SamplingParams)
    min_tokens: NonNegInt | None = None
    cache_salt: CacheSalt | None = None
    # Not implemented: any value is a 400.
    reasoning: ReasoningConfig | None = None
    include: None = None
    top_logprobs: None = None
    max_tool_calls: None = None
    service_tier: None = None
    conversation: None = None
    prompt: None = None


# ----------------------------------------------------------------------------------------- responses


class ResponseUsage(OpenModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(OpenModel):
    """A response (as the `openai` SDK's `Response`): output items, status, usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    metadata: dict[str, str] | None = None


class ResponseDeleted(OpenModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
