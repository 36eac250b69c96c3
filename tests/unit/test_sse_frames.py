"""Streamed chunks are byte-for-byte the JSON of the whole payload, whatever the fields hold."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine import SamplingParams
from server.field_map import CHAT_FIELDS
from server.plan import GenerationPlan
from server.serving_chat import _ChatStream
from server.serving_completions import _CompletionStream
from server.sse import sse_frame
from tests.unit.server_fakes import FakeEngine


def _stream(cls: type, include_usage: bool, model: str, request_id: str):
    options = SimpleNamespace(include_usage=include_usage) if include_usage else None
    req = SimpleNamespace(stream_options=options, logprobs=None, echo=False)
    plan = GenerationPlan(
        FakeEngine(), model, request_id, [(None, [1, 2])], SamplingParams(), CHAT_FIELDS
    )
    return cls(plan, req, None, 1_700_000_000)


@pytest.mark.parametrize("cls", [_ChatStream, _CompletionStream])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", 'mödel "quoted" \\ 模型'])
def test_chunk_frame_equals_the_json_of_the_whole_payload(cls, include_usage, model):
    stream = _stream(cls, include_usage, model, 'cmpl-ü"1')
    choices = [{"index": 0, "text": 'héllo \u2028 "x"\n', "logprobs": None, "finish_reason": None}]
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    metrics = {"cost": 1.5, "name": "ß"}
    for usage_arg, metrics_arg in [(None, None), (usage, None), (usage, metrics)]:
        payload = {
            "id": 'cmpl-ü"1',
            "object": cls.object_name,
            "created": 1_700_000_000,
            "model": model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if include_usage:
            payload["usage"] = usage_arg
        if metrics_arg is not None:
            payload["metrics"] = metrics_arg
        frame = stream._chunk(choices, usage_arg, metrics_arg)
        assert frame == sse_frame(payload)
        assert json.loads(frame.removeprefix("data: ")) == payload
