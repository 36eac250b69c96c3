"""The skeleton of every streamed response (opening frames, frames per engine output, an in-band error
once the 200 is sent, closing frames), and what chat and text completions share over it: the usage
block, and the chunk stream that ends with usage (and the opt-in cost sheet) and [DONE]."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from engine import CompletionOutput, RequestOutput
from server.cost_sheet import cost_sheet
from server.errors import APIError, to_api_error
from server.field_map import FieldMap
from server.generation import ClientDisconnected
from server.sse import DONE_FRAME, sse_frame, to_json
from server.turn import TurnStep, TurnStream

if TYPE_CHECKING:
    from engine import Tokenizer
    from server.plan import GenerationPlan


def usage_block(
    prompt_tokens: int, completion_tokens: int, cached: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; with a reasoning parser on, how many completion tokens reasoned."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class FrameStream:
    """Base of a streamed response: delta engine outputs (index of the engine request, output) -> SSE
    frames; a failure after the 200 status is one in-band error frame (naming the request's fields
    through `fields`), and ends the stream."""

    fields: FieldMap  # the surface's names for the fields an error blames

    def _opening_frames(self, first: RequestOutput | None) -> Iterable[str]:
        return ()

    def _output_frames(self, index: int, output: RequestOutput) -> list[str]:
        raise NotImplementedError

    def _error_frame(self, error: APIError) -> str:
        raise NotImplementedError

    def _closing_frames(self) -> Iterable[str]:
        raise NotImplementedError

    async def frames(
        self,
        first: tuple[int, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncIterator[str]:
        # The frames of one engine output go out in one write (one send, one syscall).
        try:
            opening = "".join(self._opening_frames(first[1] if first is not None else None))
            if opening:
                yield opening
            if first is not None:
                frames = self._output_frames(*first)
                if frames:
                    yield "".join(frames)
            async for index, output in outputs:
                frames = self._output_frames(index, output)
                if frames:
                    yield "".join(frames)
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield self._error_frame(to_api_error(e, self.fields))
            return
        finally:
            await outputs.aclose()
        for frame in self._closing_frames():
            yield frame


class ChunkStream(FrameStream):
    """Chat and text completion chunks: subclasses set `object_name` and turn one engine output into
    frames."""

    object_name = ""

    def __init__(
        self,
        plan: GenerationPlan,
        req: Any,
        tokenizer: Tokenizer,
        created: int,
        with_metrics: bool = False,
    ) -> None:
        self.plan = plan
        self.fields = plan.fields
        self.req = req
        self.tokenizer = tokenizer
        self.n = plan.params.n
        self.prompt_tokens = plan.num_prompt_tokens
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.turns: dict[int, TurnStream] = {}  # choice index -> its turn so far
        self.output_tokens: dict[int, int] = {}  # choice index -> tokens generated so far
        self.reasoning_tokens: dict[int, int] = {}  # choice index -> of those, reasoning
        self.thinking = plan.thinking  # a reasoning parser is on (usage counts reasoning tokens)
        self.cached: dict[int, int] = {}  # prompt index -> prompt tokens served from the cache
        self.with_metrics = with_metrics
        # Prompt index -> its engine request's last output.
        self.finals: dict[int, RequestOutput] = {}
        # Every chunk starts alike: serialise that head once, not per token.
        self._head = (
            f'data: {{"id":{to_json(plan.request_id)},"object":{to_json(self.object_name)},'
            f'"created":{to_json(created)},"model":{to_json(plan.model)},"choices":'
        )

    def _chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> str:
        frame = self._head + to_json(choices) + ',"system_fingerprint":null'
        if self.include_usage:
            frame += ',"usage":' + to_json(usage)
        if metrics is not None:
            frame += ',"metrics":' + to_json(metrics)
        return frame + "}\n\n"

    def _feed(self, index: int, out: CompletionOutput) -> tuple[TurnStream, TurnStep]:
        """Choice `index`'s next engine output as a turn step (its tokens counted)."""
        turn = self.turns.get(index) or self.turns.setdefault(index, self.plan.turn_stream())
        step = turn.feed(out)
        self.output_tokens[index] = step.output_tokens
        self.reasoning_tokens[index] = step.reasoning_tokens
        return turn, step

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        raise NotImplementedError

    def _output_frames(self, index: int, output: RequestOutput) -> list[str]:
        self.finals[index] = output
        return self._frames_for(index, output)

    def _error_frame(self, error: APIError) -> str:
        return sse_frame(error.body())

    def _closing_frames(self) -> list[str]:
        frames = []
        metrics = None
        if self.with_metrics:
            metrics = cost_sheet([self.finals[i] for i in sorted(self.finals)])
        if self.include_usage or metrics is not None:
            usage = usage_block(
                self.prompt_tokens,
                sum(self.output_tokens.values()),
                sum(self.cached.values()),
                sum(self.reasoning_tokens.values()) if self.thinking else None,
            )
            frames.append(self._chunk([], usage, metrics))
        return [*frames, DONE_FRAME]
