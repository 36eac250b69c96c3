"""GenerationPlan: what every generating API surface parses its request into (prompts, sampling params
with their constraint, the tool plan, the field map its errors are named through), and how a plan
runs: its engine requests, an HTTP error while refused, SSE frames or the finished outputs."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from engine import CompletionOutput, EngineClient, RequestOutput, SamplingParams
from engine.text import ToolPlan
from server.field_map import FieldMap
from server.generation import ClientDisconnected, first_output, merge_outputs, start_streams
from server.sse import sse_response
from server.turn import Turn, TurnStream, final_turn

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output)
# The SSE frames of a streamed response from its first output and the rest of the outputs.
StreamFrames = Callable[[tuple[int, RequestOutput] | None, Outputs], AsyncIterator[str]]


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request ready for the engine it was checked against: one engine request per
    prompt."""

    engine: EngineClient
    model: str
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    fields: FieldMap  # the surface's names for the fields its errors blame
    num_top: int = 0  # top logprobs per token (0: none)
    tools: ToolPlan | None = None  # how the tools are prompted, forced and parsed
    parallel_tool_calls: bool | None = None
    thinking: bool = False  # a reasoning parser is on: outputs report their reasoning apart
    lora: str | None = None  # the LoRA adapter the request's `model` selected (None: the base)
    cache_salt: str | None = None  # prefix-cache blocks shared only with the same salt

    @property
    def prompt_ids(self) -> list[int]:
        """The (first) prompt's token ids: a chat-shaped plan has exactly one prompt."""
        return self.prompts[0][1]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    def turn_stream(self) -> TurnStream:
        """The decoder of one streamed sample into turn events."""
        return TurnStream(self.tools, self.parallel_tool_calls)

    def final_turn(self, out: CompletionOutput) -> Turn:
        return final_turn(out, self.tools, self.parallel_tool_calls)

    def open(self, raw: Request | None) -> Outputs:
        """Start the engine requests; the outputs stream aborts them when closed or when `raw`
        disconnects."""
        streams = start_streams(
            self.engine, self.request_id, self.prompts, self.params, raw, self.lora, self.cache_salt
        )
        return merge_outputs(streams, raw)

    async def respond(
        self,
        raw: Request,
        stream: StreamFrames | None,
        finish: Callable[[list[RequestOutput]], Response],
    ) -> Response:
        """Run the plan: refused, an HTTP error naming the surface's fields; streamed, the SSE frames
        of `stream`; else `finish` of each prompt's last output. 499 once the client has gone."""
        outputs = self.open(raw)
        try:
            first = await first_output(outputs, self.fields)
            if stream is not None:
                return sse_response(stream(first, outputs))
            latest: dict[int, RequestOutput] = {}
            if first is not None:
                latest[first[0]] = first[1]
            async for index, output in outputs:
                latest[index] = output
        except ClientDisconnected:
            return Response(status_code=499)
        finals = [latest[i] for i in range(len(self.prompts))]
        assert all(f.outputs for f in finals), "the engine ended a request without output"
        return finish(finals)
