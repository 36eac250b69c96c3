"""Pydantic models of the OpenAI API: completions, chat, embeddings, models; tokenize/detokenize; score.

Requests are strict: wrong types, out-of-range values and unknown fields are 400s, and OpenAI fields that
kvserve does not implement are typed `None` so that any real value is rejected with the field's name.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

MAX_N = 128
MAX_STOP = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat has none)
NonNegInt = Annotated[int, Field(ge=0)]
# OpenAI's reasoning efforts (chat's reasoning_effort, Responses' reasoning.effort): given to the chat
# template as `reasoning_effort`, as vLLM does; templates that know it (gpt-oss's) act on it.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]


def _non_empty_salt(value: str) -> str:
    if not value:
        raise ValueError("must be a non-empty string if provided")
    return value


# vLLM's `cache_salt` (completions, chat, Responses, Messages): prefix-cache blocks are shared only
# with requests of the same salt (a tenant's own); an empty salt is refused, as vLLM does.
CacheSalt = Annotated[str, AfterValidator(_non_empty_salt)]

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _metadata_limits(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys")
    long = next((k for k in value if len(k) > MAX_METADATA_KEY_CHARS), None)
    if long is not None:
        raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
    return value


# OpenAI's `metadata` (chat completions, Responses): up to 16 string pairs for the caller's own
# bookkeeping; checked as OpenAI does, never read by the model.
Metadata = Annotated[
    dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
    AfterValidator(_metadata_limits),
]


# Deeper than this, a request's JSON is no structure a model can be asked for (llguidance refuses
# schemas past ~127 levels) and would only exhaust recursion further on: a 400 names the depth.
MAX_NESTING = 200


def _text_problem(value: Any) -> str | None:
    """What makes a field's value unusable, or None: text with an unpaired UTF-16 surrogate (JSON
    may escape half a pair, "\\ud800"; such text cannot be tokenized or sent back), or nesting
    deeper than MAX_NESTING. Walked with a stack, so any depth is safe to look at."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return "the text is not valid Unicode: it contains an unpaired surrogate"
        elif isinstance(item, dict) or (
            isinstance(item, list) and item and isinstance(item[0], (str, list, dict))
        ):
            if depth >= MAX_NESTING:
                return f"the value nests more than {MAX_NESTING} levels deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


class PartError(ValueError):
    """A content part this server does not take: raised by a `content` validator, its error path
    names the part (`messages[0].content[1]`), not only the content list."""

    def __init__(self, index: int, kind: str) -> None:
        super().__init__(f"only text content parts are supported, but this part has type {kind!r}")
        self.index = index


class StrictModel(BaseModel):
    # NaN and infinities are no sampling value: "must be a finite number", not a range error.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        problem = _text_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


def typed_union(members: dict[str, type], default: str | None = None) -> Any:
    """A union of models chosen by their `type` field (`default` when the field is absent). The tags are
    spelled `type[...]` so that error paths stay the request's own (`input[0].content`), and an unknown
    type gets one error listing the known ones."""

    def kind(value: Any) -> str | None:
        tag = value.get("type", default) if isinstance(value, dict) else None
        return f"type[{tag}]" if isinstance(tag, str) and tag in members else None

    tagged = tuple(Annotated[model, Tag(f"type[{tag}]")] for tag, model in members.items())
    known = ", ".join(repr(tag) for tag in members)
    return Annotated[
        Union[tagged],  # noqa: UP007 - built at run time
        Discriminator(
            kind,
            custom_error_type="invalid_type_tag",
            custom_error_message=f"the type must be one of {known}",
        ),
    ]


class OpenModel(BaseModel):
    """Response models: tolerant of extension fields, never validated against client input."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------------ requests


class StreamOptions(StrictModel):
    include_usage: bool | None = False


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(StrictModel):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


if TYPE_CHECKING:
    ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema
else:  # error paths stay the request's own: response_format.json_schema, not ...json_schema.json_schema
    ResponseFormat = typed_union(
        {
            "text": ResponseFormatText,
            "json_object": ResponseFormatJsonObject,
            "json_schema": ResponseFormatJsonSchema,
        }
    )


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` extension: exactly one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None  # accepted: kvserve's JSON is compact already
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    structural_tag: None = None  # not implemented: any value is a 400


class SamplingFields(StrictModel):
    """Fields shared by completions and chat: sampling, stopping, streaming and common extensions."""

    model: str | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: int | None = None  # its range is the engine's rule (SamplingParams)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # Extensions (vLLM names).
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: NonNegInt | None = None
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[NonNegInt], Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    # Structured outputs (OpenAI's response_format; vLLM's structured_outputs).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # kvserve: add the per-request cost sheet (`metrics`); null defers to the X-KVServe-Metrics header.
    return_metrics: bool | None = None
    cache_salt: CacheSalt | None = None
    # vLLM: top-N logprobs of every prompt token (the first has none), in vLLM's shape.
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM: logprob tokens as "token_id:<id>" (for clients that cannot map strings back to ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM: keep only the last N prompt tokens (-1: as many as the model takes).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # vLLM's guided decoding fields (its older spelling of structured_outputs).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM fields whose neutral value is accepted and any other refused by name (see below).
    priority: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    spaces_between_special_tokens: bool | None = None
    # vLLM fields kvserve cannot honour: any value is a 400 naming them.
    allowed_token_ids: None = None
    bad_words: None = None
    guided_decoding_backend: None = None
    logits_processors: None = None

    @field_validator("priority")
    @classmethod
    def _no_priority(cls, value: int | None) -> int | None:
        if value not in (None, 0):
            raise ValueError(
                "priority scheduling is not available on this server: requests are served first "
                "come, first served (give 0 or leave it out)"
            )
        return value

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("beam search is not supported by this server")
        return value

    @field_validator("length_penalty")
    @classmethod
    def _no_length_penalty(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError("length_penalty applies to beam search, which this server lacks")
        return value

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaces_between_special_tokens(cls, value: bool | None) -> bool | None:
        if value is False:
            raise ValueError("only true is supported (special tokens are decoded as written)")
        return value


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: NonNegInt | None = DEFAULT_COMPLETION_MAX_TOKENS  # null: the default too
    suffix: None = None  # not implemented: any value is a 400
    add_special_tokens: bool | None = True  # vLLM: the tokenizer's BOS (and such) on text prompts


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages that called tools
    tool_call_id: str | None = None  # tool messages: the call they answer
    function_call: None = None
    refusal: str | None = None
    audio: None = None
    # A reply's reasoning, as this server returns it (either name): given to the template as
    # `reasoning_content`, which templates that show it render (most drop earlier turns').
    reasoning_content: str | None = None
    reasoning: str | None = None
    # An SDK's model_dump() of a reply carries these back: citations are kept by no template, so
    # they are accepted and left out of the prompt.
    annotations: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool":
            if not self.tool_call_id:
                raise ValueError(
                    "a tool message needs tool_call_id (the id of the call it answers)"
                )
            if self.content is None:
                raise ValueError("a tool message needs content (the tool's result)")
        elif self.tool_call_id is not None:
            raise ValueError("tool_call_id is only allowed on messages with role 'tool'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.content is None and self.role == "assistant" and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Name the real problem (an image or audio part) instead of the union's type mismatch."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PartError(i, kind)
        return value


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None -> no arguments
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class PredictionText(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's predicted output (`prediction`): content the answer will likely repeat."""

    type: Literal["content"]
    content: str | list[PredictionText]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tokens: int | None = None  # at least 1 (checked below, worded like max_tokens: 0)
    max_completion_tokens: int | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    function_call: Literal["none"] | None = None
    modalities: list[Literal["text"]] | None = None
    store: Literal[False] | None = None
    metadata: Metadata | None = None
    # One tier here: what "auto" and "default" ask for (flex and priority are refused below).
    service_tier: Literal["auto", "default"] | None = None
    # Predicted output: only a hint to go faster, never a change to the text; taken and not used.
    prediction: Prediction | None = None
    prompt_cache_key: str | None = None  # a routing hint; prefix caching is automatic here
    safety_identifier: str | None = None
    # Extensions.
    add_generation_prompt: bool | None = True
    # vLLM: the tokenizer's special tokens (BOS and such) on top of what the chat template writes;
    # off by default, as the template already adds the ones the model wants.
    add_special_tokens: bool | None = False
    # Extra chat template variables (vLLM's field), e.g. {"enable_thinking": false}; they override
    # the server's --chat-template-kwargs.
    chat_template_kwargs: dict[str, Any] | None = None
    # Not implemented: any value is a 400.
    functions: None = None
    audio: None = None
    reasoning_effort: ReasoningEffort | None = None
    web_search_options: None = None
    verbosity: None = None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _at_least_one(cls, value: int | None) -> int | None:
        """OpenAI's rule for chat (completions alone take 0, with echo): -1 and 0 worded alike."""
        if value is not None and value < 1:
            raise ValueError("must be at least 1 for chat completions")
        return value


class ScoreRequest(StrictModel):
    """POST /v1/score: how likely each choice is as the continuation of a context."""

    model: str | None = None
    # The context: exactly one of a prompt (text or token ids) and chat messages (checked by the route).
    prompt: str | TokenIds | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # At least one; the most is the server's --max-score-choices (checked by the route).
    choices: (
        Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    )
    normalize: Literal["sum", "mean"] | None = "sum"
    include_end_of_turn: bool | None = False
    # kvserve: add the per-request cost sheet (`metrics`); null defers to the X-KVServe-Metrics header.
    return_metrics: bool | None = None
    token_logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    user: str | None = None


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # vLLM's defaults: on for a prompt, off for messages (the chat template writes any BOS)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[NonNegInt]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the number of inputs in one request


class EmbeddingRequest(StrictModel):
    model: str | None = None
    # Emptiness (of a string, a list or an inner list) is checked by the route, naming `input`.
    # The count is checked after the union is chosen: a length bound inside it made a too-long
    # list of strings fail as "input[0]: Input should be a valid integer" (the next branch).
    input: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # Extension (vLLM): keep only the last N tokens of each input; -1 means the model's maximum.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # Extension (text-embeddings-inference): the model's named instruction prompt to prepend to text
    # inputs (config_sentence_transformers.json `prompts`); null: its default_prompt_name, if any.
    prompt_name: str | None = None

    @field_validator("input")
    @classmethod
    def _at_most_max_inputs(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) > MAX_EMBEDDING_INPUTS:
                raise ValueError(
                    f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}"
                )
        return value


# ----------------------------------------------------------------------------------------- responses


class PromptTokensDetails(OpenModel):
    cached_tokens: int = 0


class Usage(OpenModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


class CompletionChoice(OpenModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenModel):
    """Also the shape of each streamed completion chunk (finish_reason null until the end)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(OpenModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatToolCallFunction(OpenModel):
    name: str
    arguments: str


class ChatToolCall(OpenModel):
    id: str
    type: Literal["function"] = "function"
    function: ChatToolCallFunction


class ChatResponseMessage(OpenModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatChoice(OpenModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class EmbeddingData(OpenModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format=base64)


class EmbeddingUsage(OpenModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ScoreTopLogprob(OpenModel):
    token: str
    token_id: int
    logprob: float


class ScoreChoice(OpenModel):
    index: int
    text: str
    logprob: float  # log P(choice | context)
    mean_logprob: float
    probability: float  # softmax over the choices (by sum or mean logprob): they sum to 1
    num_tokens: int
    is_greedy: bool
    token_logprobs: list[float] | None = (
        None  # with token_logprobs: true, one per token of `tokens`
    )
    tokens: list[str] | None = None


class ScoreUsage(OpenModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ScoreResponse(OpenModel):
    object: Literal["score"] = "score"
    id: str
    created: int
    model: str
    choices: list[ScoreChoice]
    top_logprobs: list[ScoreTopLogprob] | None = None  # with top_logprobs: k
    usage: ScoreUsage


class ModelCard(OpenModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str | None = None  # the base model's source; an adapter's folder
    parent: str | None = None  # a LoRA adapter's base model (None for the base model)
    max_model_len: int | None = None


class ModelList(OpenModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenModel):
    prompt: str


class ErrorInfo(OpenModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenModel):
    error: ErrorInfo
