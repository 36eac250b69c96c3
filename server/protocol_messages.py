"""Pydantic models of Anthropic's Messages API requests (`POST /v1/messages`, `.../count_tokens`): text,
tool_use and tool_result blocks, tools and tool_choice. Strict: unknown fields and unimplemented features
are 400s in Anthropic's error envelope."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator

from server.protocol import MAX_STOP, CacheSalt, OpenModel, StrictModel, typed_union

MAX_STOP_SEQUENCES = MAX_STOP


class CacheControl(StrictModel):
    """Accepted and ignored: prefix caching is automatic (cache_read_input_tokens reports it)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class DirectCaller(StrictModel):
    """Who made a tool call: the model itself (the only caller without server-side tools)."""

    type: Literal["direct"]


class ToolUseBlock(StrictModel):
    """A tool call the assistant made earlier, replayed as history (also as the SDK's
    `model_dump()` of a response block writes it: `caller` and `toolset_name` null)."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    toolset_name: str | None = None


class ToolResultBlock(StrictModel):
    """The caller's result of a tool call, matched to it by `tool_use_id`."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(StrictModel):
    """An earlier reply's thinking, replayed as history: accepted and left out of the prompt
    (chat templates drop the reasoning of earlier turns)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking's
    cache_control: CacheControl | None = None


class ThinkingConfig(StrictModel):
    """`thinking`: enabled (or adaptive) / disabled -> the chat template's `enable_thinking`; the
    budget is not enforced (max_tokens bounds reasoning and answer together)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None
    display: Literal["summarized", "omitted"] | None = None


if TYPE_CHECKING:
    ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
else:
    ContentBlock = typed_union(
        {
            "text": TextBlock,
            "tool_use": ToolUseBlock,
            "tool_result": ToolResultBlock,
            "thinking": ThinkingBlock,
            "redacted_thinking": ThinkingBlock,
        }
    )


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, value: Any) -> Any:
        """Name the real problem (an image or document block) instead of the union's mismatch."""
        if isinstance(value, list):
            for i, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in (
                    "text",
                    "tool_use",
                    "tool_result",
                    "thinking",
                    "redacted_thinking",
                ):
                    raise ValueError(
                        "only text, tool_use and tool_result blocks are supported, "
                        f"but block {i} has type {kind!r}"
                    )
        return value


class Tool(StrictModel):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('the input schema must have "type": "object"')
        return value


class ToolChoiceAuto(StrictModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(StrictModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(StrictModel):
    type: Literal["tool"]
    name: Annotated[str, Field(min_length=1)]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(StrictModel):
    type: Literal["none"]


if TYPE_CHECKING:
    ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone
else:
    ToolChoice = typed_union(
        {
            "auto": ToolChoiceAuto,
            "any": ToolChoiceAny,
            "tool": ToolChoiceTool,
            "none": ToolChoiceNone,
        }
    )


class MessagesMetadata(StrictModel):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = None
    # Anthropic's effort levels; passed to the chat template as `reasoning_effort`, like chat's
    # reasoning_effort and Responses' reasoning.effort.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesInput(StrictModel):
    """What both endpoints read: the conversation, its tools and its output format."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the older name of output_config.format
    cache_control: CacheControl | None = None
    speed: Literal["standard"] | None = None
    thinking: ThinkingConfig | None = None
    # Not implemented: any value is a 400.
    mcp_servers: None = None
    inference_geo: None = None
    diagnostics: None = None
    user_profile_id: None = None
    workspace_id: None = None

    def json_schema(self) -> dict[str, Any] | None:
        """The output's JSON schema, from output_config.format or output_format."""
        config = self.output_config.format if self.output_config is not None else None
        fmt = config or self.output_format
        return fmt.schema_ if fmt is not None else None


class CountTokensRequest(MessagesInput):
    pass


class MessagesRequest(MessagesInput):
    max_tokens: Annotated[int, Field(ge=1)]
    # kvserve: add the per-request cost sheet (`metrics`); null defers to the X-KVServe-Metrics header.
    return_metrics: bool | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    # Sampling: newer SDKs no longer list these (send them with extra_body); raw HTTP clients do.
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool | None = False
    metadata: MessagesMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    cache_salt: CacheSalt | None = None  # vLLM's extension (send it with extra_body)
    # Not implemented: any value is a 400.
    container: None = None
    context_management: None = None


# ----------------------------------------------------------------------------------------- responses


class AnthropicUsage(OpenModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageObject(OpenModel):
    """A reply: text and tool_use blocks (as the `anthropic` SDK's `Message`)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageTokensCount(OpenModel):
    input_tokens: int


class AnthropicErrorInfo(OpenModel):
    type: str
    message: str


class AnthropicErrorResponse(OpenModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
