"""Reasoning output end to end: a scripted tiny Llama (its next token is a fixed function of the
current one, so the output is known) behind a Qwen3-style chat template with a thinking block, read
through the official SDKs: chat `reasoning_content` whole and streamed, the Responses reasoning
item, the Messages thinking block; enable_thinking per request and as the server default; a template
that opens `<think>` in the prompt; the reasoning effort handed to the template; JSON schemas, tools and stop strings applied to the answer only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import TINY_ARGS, ServerProcess

REASONING = 'Maybe <tool_call>{"name":"get_weather","arguments":{}}</tool_call> no. Halt here?'
ANSWER = "Sunny today"
THINKING_OFF = "<think>\n\n</think>\n\n"

# A Qwen3-style template: native tools in Hermes format, `enable_thinking: false` closes the block;
# a reasoning effort, when given, is stated in a system turn (as gpt-oss's template does).
QWEN3_STYLE = (
    "{%- if reasoning_effort is defined %}"
    "{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}"
    '{{- tool | tojson }}{%- endfor %}{{- \'</tools>\\nCall a tool with <tool_call>{"name": ..., '
    '"arguments": {...}}</tool_call><|im_end|>\\n\' }}{%- endif %}'
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# A Qwen3-Thinking / DeepSeek-R1-style template: the prompt itself opens the thinking block.
OPENS_THINK = QWEN3_STYLE.replace(
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>' }}{%- endif %}",
)


def _scripted_checkpoint(smollm2_dir: Path, out: Path) -> None:
    """SmolLM2's tokenizer with Qwen3's tags as added tokens, and a 2-layer Llama whose attention
    and MLP outputs are zero, so each next token depends on the current one only: after the
    generation prompt's "\\n" it writes `<think>REASONING</think>ANSWER` and ends; after the
    closed block (thinking off) it answers at once."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.save_pretrained(out)
    script = tok.encode(f"<think>{REASONING}</think>{ANSWER}", add_special_tokens=False)
    eos = tok.eos_token_id
    nl = tok.encode("\n", add_special_tokens=False)
    after_off = tok.encode(THINKING_OFF, add_special_tokens=False)[-1]
    answer_start = tok.encode(ANSWER, add_special_tokens=False)[0]
    successor = {nl[-1]: script[0], after_off: answer_start}
    successor.update(zip(script, [*script[1:], eos], strict=True))
    assert len(set(script)) == len(script), "each scripted token must have one successor"
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for k, (current, following) in enumerate(successor.items()):
            model.model.embed_tokens.weight[current, k] = 1.0
            model.lm_head.weight[following, k] = 10.0
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos).save_pretrained(out)


@pytest.fixture(scope="module")
def scripted_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scripted_thinker")
    _scripted_checkpoint(smollm2_dir, out)
    (out / "qwen3_style.jinja").write_text(QWEN3_STYLE)
    (out / "opens_think.jinja").write_text(OPENS_THINK)
    return out


def _serve(model: Path, logs: Path, *args: str) -> ServerProcess:
    server = ServerProcess(model, [*TINY_ARGS, "--quantization", "none", *args], logs)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def server(scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("logs") / "thinker.log"
    server = _serve(scripted_dir, logs, "--chat-template", str(scripted_dir / "qwen3_style.jinja"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


HELLO: Any = [{"role": "user", "content": "Weather?"}]


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=extra.pop("messages", HELLO),
        max_tokens=extra.pop("max_tokens", 60),
        temperature=0,
        **extra,
    )


def test_chat_returns_reasoning_apart_from_the_answer(client: openai.OpenAI):
    reply = _chat(client)
    message = reply.choices[0].message
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert message.reasoning == REASONING  # type: ignore[attr-defined]
    assert message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    reasoning_tokens = reply.usage.completion_tokens_details.reasoning_tokens
    # <think> + the reasoning + </think>, of all completion tokens (the answer and EOS too).
    assert reasoning_tokens is not None and 0 < reasoning_tokens < reply.usage.completion_tokens


def test_chat_streams_reasoning_before_the_content(client: openai.OpenAI):
    stream = _chat(client, stream=True, stream_options={"include_usage": True})
    kinds, reasoning, content = [], "", ""
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        if piece:
            assert getattr(delta, "reasoning", None) == piece
            reasoning += piece
            kinds.append("reasoning")
        if delta.content:
            content += delta.content
            kinds.append("content")
    assert (reasoning, content) == (REASONING, ANSWER)
    assert kinds.index("content") > len(kinds) - 1 - kinds[::-1].index("reasoning")
    whole = _chat(client)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == (
        whole.usage.completion_tokens_details.reasoning_tokens
    )


def test_enable_thinking_false_per_request(client: openai.OpenAI):
    reply = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert getattr(message, "reasoning_content", None) is None


def test_reasoning_effort_reaches_the_chat_template(client: openai.OpenAI, server: ServerProcess):
    """chat's reasoning_effort, Responses' reasoning.effort and Messages' output_config.effort are
    the template's
    `reasoning_effort` (vLLM's variable), here a system turn of the prompt."""
    plain = _chat(client)
    high = _chat(client, reasoning_effort="high")
    assert high.choices[0].message.content == ANSWER
    assert plain.usage is not None and high.usage is not None
    extra = high.usage.prompt_tokens - plain.usage.prompt_tokens
    assert extra > 0  # "<|im_start|>system\nReasoning: high<|im_end|>\n"
    model = client.models.list().data[0].id
    ask: Any = {"model": model, "input": "Weather?", "max_output_tokens": 60, "temperature": 0}
    base = client.responses.create(**ask)
    assert base.reasoning is not None and base.reasoning.effort is None
    response = client.responses.create(**ask, reasoning={"effort": "high", "summary": "auto"})
    assert response.output_text == ANSWER
    assert response.reasoning is not None
    assert (response.reasoning.effort, response.reasoning.summary) == ("high", "auto")
    assert base.usage is not None and response.usage is not None
    assert response.usage.input_tokens - base.usage.input_tokens == extra
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, extra_body={"reasoning_effort": "extreme"})
    assert bad.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(**ask, reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]
    assert bad.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    # Messages' output_config.effort: the same template variable, so the same prompt.
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    mbase = claude.messages.create(model=model, max_tokens=60, messages=HELLO)
    mhigh = claude.messages.create(
        model=model, max_tokens=60, messages=HELLO, output_config={"effort": "high"}
    )

    def prompt_tokens(
        usage: anthropic.types.Usage,
    ) -> int:  # Anthropic's counts leave cache reads out
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert prompt_tokens(mhigh.usage) - prompt_tokens(mbase.usage) == extra
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=model,
            max_tokens=60,
            messages=HELLO,
            output_config={"effort": "extreme"},  # type: ignore[typeddict-item]
        )
    assert "output_config.effort" in str(refused.value)


def test_a_tool_call_inside_the_reasoning_is_not_a_call(client: openai.OpenAI):
    tools: Any = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object"}},
        }
    ]
    reply = _chat(client, tools=tools)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert choice.message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert choice.message.content == ANSWER


def test_a_forced_tool_call_follows_the_reasoning(client: openai.OpenAI):
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Paris"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    for stream in (False, True):
        if stream:
            calls: dict[int, list[str]] = {}
            reasoning = ""
            for chunk in _chat(client, tools=tools, tool_choice="required", stream=True):
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                for call in delta.tool_calls or []:
                    parts = calls.setdefault(call.index, ["", ""])
                    parts[0] += (call.function.name or "") if call.function else ""
                    parts[1] += (call.function.arguments or "") if call.function else ""
            assert reasoning == REASONING
            assert calls[0][0] == "get_weather"
            assert json.loads(calls[0][1]) == {"city": "Paris"}
            continue
        reply = _chat(client, tools=tools, tool_choice="required")
        choice = reply.choices[0]
        assert choice.message.reasoning_content == REASONING  # type: ignore[attr-defined]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls is not None
        call = choice.message.tool_calls[0].function  # type: ignore[union-attr]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_a_json_schema_constrains_only_the_answer(client: openai.OpenAI):
    schema = {
        "type": "object",
        "properties": {"sky": {"enum": ["sunny", "rainy"]}},
        "required": ["sky"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    reply = _chat(client, response_format=response_format)
    message = reply.choices[0].message
    assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert json.loads(message.content or "")["sky"] in ("sunny", "rainy")


def test_stop_strings_apply_to_the_answer_not_the_reasoning(client: openai.OpenAI):
    reply = _chat(client, stop=["Halt", "today"])  # "Halt" is only in the reasoning
    choice = reply.choices[0]
    assert choice.message.reasoning_content == REASONING  # type: ignore[attr-defined]
    assert choice.message.content == "Sunny "
    assert choice.finish_reason == "stop"


def test_responses_reasoning_item(client: openai.OpenAI):
    response = client.responses.create(
        model=client.models.list().data[0].id, input="Weather?", max_output_tokens=60
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content is not None
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", REASONING)]
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage is not None
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    # The reasoning item passed back as input is accepted.
    follow = client.responses.create(
        model=response.model,
        input=[
            *[item.model_dump(exclude_none=True) for item in response.output],
            {"role": "user", "content": "And tomorrow?"},
        ],
        max_output_tokens=60,
    )
    assert follow.output_text == ANSWER


def test_responses_stream_reasoning_events(client: openai.OpenAI):
    events = list(
        client.responses.create(
            model=client.models.list().data[0].id,
            input="Weather?",
            max_output_tokens=60,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == REASONING and [e.text for e in done] == [REASONING]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]
    assert final.response.output_text == ANSWER


def test_messages_thinking_block(server: ServerProcess):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    message = client.messages.create(model=model, max_tokens=60, messages=HELLO)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING
    assert isinstance(thinking.signature, str)
    assert text.type == "text" and text.text == ANSWER
    with client.messages.stream(model=model, max_tokens=60, messages=HELLO) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == REASONING  # type: ignore[union-attr]
    # thinking disabled: the template's enable_thinking is false, the answer comes at once.
    off = client.messages.create(
        model=model, max_tokens=60, messages=HELLO, thinking={"type": "disabled"}
    )
    assert [(b.type, getattr(b, "text", None)) for b in off.content] == [("text", ANSWER)]
    # The thinking block passed back as history is accepted.
    history: Any = [
        *HELLO,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": "Thanks"},
    ]
    again = client.messages.create(model=model, max_tokens=60, messages=history)
    assert again.content[-1].type == "text"


def test_bad_chat_template_kwargs_are_400s(server: ServerProcess):
    for kwargs, fragment in (([1], "chat_template_kwargs"), ({"tools": []}, "'tools'")):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": HELLO, "chat_template_kwargs": kwargs},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("chat_template_kwargs") and fragment in error["message"]


def test_template_that_opens_the_block_and_server_default_kwargs(
    scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory
):
    logs = tmp_path_factory.mktemp("logs") / "opens.log"
    server = _serve(
        scripted_dir,
        logs,
        "--chat-template",
        str(scripted_dir / "opens_think.jinja"),
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        off = _chat(client).choices[0].message  # the server default closes the block
        assert (off.content, getattr(off, "reasoning_content", None)) == (ANSWER, None)
        # The request overrides it: the prompt ends in `<think>`, the output starts in reasoning.
        on = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        message = on.choices[0].message
        assert message.reasoning_content == REASONING  # type: ignore[attr-defined]
        assert message.content == ANSWER
    finally:
        server.stop()


def test_unknown_reasoning_parser_is_a_startup_error(scripted_dir: Path, tmp_path: Path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "server", "serve", str(scripted_dir), "--reasoning-parser", "r2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "reasoning-parser" in result.stderr and "qwen3" in result.stderr


def test_offline_llm_chat_splits_the_same_way(scripted_dir: Path):
    from engine import LLM, SamplingParams

    llm = LLM(
        str(scripted_dir),
        dtype="float32",
        device="cpu",
        quantization="none",
        chat_template=str(scripted_dir / "qwen3_style.jinja"),
        max_model_len=256,
    )
    greedy = SamplingParams(temperature=0, max_tokens=60, stop=["Halt"])
    out = llm.chat(HELLO, greedy).outputs[0]
    assert (out.reasoning, out.text) == (REASONING, ANSWER)  # "Halt" is in the reasoning only
    off = llm.chat(HELLO, greedy, chat_template_kwargs={"enable_thinking": False}).outputs[0]
    assert (off.reasoning, off.text) == (None, ANSWER)
    raw = llm.chat(HELLO, greedy, reasoning_parser="none").outputs[0]
    assert raw.reasoning is None and raw.text.startswith("<think>Maybe")
