"""Constrained decoding in the engine: outputs always match their constraint (a property test over
generated JSON schemas on the real model; a random-weight model as an adversary), unconstrained rows
are untouched by constrained neighbours, and preemption, n, best_of, seeds and logprobs keep working."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from engine.core.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputs
from engine.llm import LLM
from engine.text.tool_use import plan_tool_use

KEYS = ["name", "age", "city", "tags", "score", "id", "kind", "items", "active", "note"]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), dtype="float32", max_num_seqs=16, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=256)


# -- schemas ------------------------------------------------------------------------------------------
_leaf = st.one_of(
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-100, 100), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    # Numbers are integral here: a JSON number's fraction has no length bound, and a 135M model can
    # repeat a digit until max_tokens (the output stays a valid prefix, but never ends).
    st.tuples(st.integers(-50, 50), st.integers(1, 100)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1], "multipleOf": 1}
    ),
    st.just({"type": "boolean"}),
    st.lists(
        st.sampled_from(["red", "green", "blue", "small", "large", "n/a"]),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(lambda xs: {"enum": xs}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(draw_props: list, required_mask: list[bool]) -> dict:
        props = {k: v for k, v in draw_props}
        required = [k for (k, _), r in zip(draw_props, required_mask, strict=False) if r]
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }

    props = st.lists(
        st.tuples(st.sampled_from(KEYS), children),
        min_size=1,
        max_size=3,
        unique_by=lambda kv: kv[0],
    )
    return st.tuples(props, st.lists(st.booleans(), min_size=3, max_size=3)).map(
        lambda t: build(t[0], t[1])
    )


def _array(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


_value = st.recursive(_leaf, lambda c: st.one_of(_object(c), _array(c)), max_leaves=5)


def _with_ref(schema: dict) -> dict:
    """The same shape with its first property moved to $defs and referenced."""
    key = next(iter(schema["properties"]))
    defs = {"Part": schema["properties"][key]}
    props = {**schema["properties"], key: {"$ref": "#/$defs/Part"}}
    return {**schema, "properties": props, "$defs": defs}


SCHEMA = st.tuples(_object(_value), st.booleans()).map(lambda t: _with_ref(t[0]) if t[1] else t[0])


def _prompt(llm: LLM, schema: dict) -> list[int]:
    text = f"Reply with a JSON value matching this JSON schema:\n{json.dumps(schema)}"
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


@settings(
    max_examples=3,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: each example is a batch
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schemas=st.lists(SCHEMA, min_size=8, max_size=8))
def test_every_output_validates_against_its_generated_schema(smol: LLM, schemas: list) -> None:
    for schema in schemas:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    params = [
        SamplingParams(
            max_tokens=400,
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=i,
            structured_outputs=StructuredOutputs(json=json.dumps(schema)),
        )
        for i, schema in enumerate(schemas)
    ]
    outs = smol.generate([_prompt(smol, s) for s in schemas], params)
    for schema, out in zip(schemas, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_random_weights_still_produce_valid_output(tiny: LLM) -> None:
    """A random model picks arbitrary tokens: only the mask keeps it valid."""
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "flag": {"type": "boolean"},
            "pick": {"enum": ["a", "b"]},
        },
        "required": ["n", "flag", "pick"],
        "additionalProperties": False,
    }
    constraints = [
        StructuredOutputs(json=json.dumps(schema)),
        StructuredOutputs(regex=r"[0-9]{2,4}-(yes|no)"),
        StructuredOutputs(choice=("alpha", "beta", "gamma")),
        StructuredOutputs(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]/'),
    ]
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=7, structured_outputs=c)
        for c in constraints
    ]
    outs = [o.outputs[0] for o in tiny.generate(["x", "y", "z", "w"], params)]
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert re.fullmatch(r"[0-9]{2,4}-(yes|no)", outs[1].text)
    assert outs[2].text in ("alpha", "beta", "gamma")
    assert all(o.finish_reason == "stop" for o in outs[:3])
    assert outs[3].finish_reason == "length" or re.fullmatch(r"\([0-9](,[0-9])*\)", outs[3].text)


def test_unconstrained_outputs_equal_their_solo_runs(tiny: LLM) -> None:
    prompts = ["The cat", "Once upon", "A B C"]
    plain = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=5),
    ]
    solo = [
        tiny.generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts, plain, strict=False)
    ]
    constrained = SamplingParams(
        max_tokens=24,
        temperature=0.9,
        seed=1,
        structured_outputs=StructuredOutputs(json_object=True),
    )
    mixed = tiny.generate(
        [prompts[0], "Numbers:", *prompts[1:]], [plain[0], constrained, *plain[1:]]
    )
    got = [mixed[0], mixed[2], mixed[3]]
    assert [o.outputs[0].token_ids for o in got] == solo


def test_preemption_n_best_of_seed_and_logprobs_with_constraints(tiny_llama_dir: Path) -> None:
    pattern = r"[a-z]{40,80}"
    so = StructuredOutputs(regex=pattern)
    params = SamplingParams(
        max_tokens=80, temperature=1.0, seed=9, n=3, logprobs=2, structured_outputs=so
    )
    roomy = LLM(str(tiny_llama_dir), dtype="float32")
    reference = roomy.generate(["p1 " * 20, "p2 " * 20], params)
    # 8 blocks of 16 tokens cannot hold 6 growing sequences: some get preempted and recomputed.
    small = LLM(str(tiny_llama_dir), dtype="float32", num_blocks=8, block_size=16)
    outs = small.generate(["p1 " * 20, "p2 " * 20], params)
    assert small.engine.totals.num_preemptions > 0
    for ref, out in zip(reference, outs, strict=True):
        assert [c.text for c in out.outputs] == [c.text for c in ref.outputs]
        for c in out.outputs:
            assert c.finish_reason == "length" or re.fullmatch(pattern, c.text)
            assert re.fullmatch("[a-z]*", c.text)
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    best = small.generate(
        ["q"],
        SamplingParams(
            max_tokens=10,
            best_of=4,
            n=2,
            seed=1,
            structured_outputs=StructuredOutputs(choice=("yes", "no", "maybe")),
        ),
    )
    assert len(best[0].outputs) == 2 and all(
        c.text in ("yes", "no", "maybe") for c in best[0].outputs
    )


def test_stop_strings_and_a_failing_matcher_fail_only_their_request(tiny: LLM) -> None:
    stop = tiny.generate(
        ["s"],
        SamplingParams(
            max_tokens=30,
            temperature=0,
            stop=["b"],
            structured_outputs=StructuredOutputs(regex="a+ba+"),
        ),
    )[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.text and "b" not in stop.text

    engine = tiny.engine
    so = StructuredOutputs(regex="[a-z]{5,20}")
    engine.add_request(
        "bad", tiny.tokenizer.encode("x"), SamplingParams(max_tokens=20, structured_outputs=so)
    )
    engine.add_request(
        "good", tiny.tokenizer.encode("y"), SamplingParams(max_tokens=20, structured_outputs=so)
    )
    engine.add_request(
        "plain", tiny.tokenizer.encode("z"), SamplingParams(max_tokens=5, temperature=0)
    )
    engine.step()
    bad_seq = engine.groups["bad"].seqs[0]
    digit = tiny.tokenizer.encode("7", add_special_tokens=False)[0]
    assert not bad_seq.matcher.consume_token(digit)  # outside [a-z]: the matcher is in error now
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert results["bad"].error is not None and "constrained decoder" in results["bad"].error
    assert results["bad"].error_param == so.source  # the request's fault: a 400, not a 500
    assert results["good"].error is None and re.fullmatch(
        "[a-z]{5,20}", results["good"].outputs[0].text
    )
    assert results["plain"].error is None


def test_a_regex_past_the_decoders_limits_fails_its_request_alone_as_a_request_error(
    tiny: LLM,
) -> None:
    # It compiles, but llguidance's lexer gives up after some tokens ("too many expressions"):
    # before, that was an empty "stop" or a 500; now the request fails blaming the regex.
    engine = tiny.engine
    for regex in ("a{99999999}", "(a{1000}){1000}"):
        so = StructuredOutputs(regex=regex, source="structured_outputs.regex")
        engine.add_request(
            "big", tiny.tokenizer.encode("x"), SamplingParams(max_tokens=30, structured_outputs=so)
        )
        engine.add_request(
            "plain", tiny.tokenizer.encode("y"), SamplingParams(max_tokens=8, temperature=0)
        )
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        assert results["big"].error_param == "structured_outputs.regex", results["big"]
        assert "constrained decoder" in (results["big"].error or "")
        assert results["plain"].error is None and len(results["plain"].outputs[0].token_ids) == 8


def test_bad_constraints_raise_naming_their_source(tiny: LLM) -> None:
    for constraint, words in [
        (StructuredOutputs(regex="(?=x)a", source="structured_outputs.regex"), "look-around"),
        (StructuredOutputs(grammar="start: nope", source="structured_outputs.grammar"), "nope"),
        (
            StructuredOutputs(
                json=json.dumps({"type": "string", "format": "nonsense"}), source="rf"
            ),
            "format",
        ),
    ]:
        with pytest.raises(SamplingParamsError) as info:
            tiny.engine.compile_constraint(constraint)
        assert info.value.param == constraint.source and words in str(info.value)
    with pytest.raises(SamplingParamsError):
        StructuredOutputs(regex="a", choice=("a",))
    # Nested past llguidance's recursion limit: its ValueError is the request's error (was a 500).
    deep = '{"a":' * 150 + "1" + "}" * 150
    with pytest.raises(SamplingParamsError) as info:
        tiny.engine.compile_constraint(StructuredOutputs(json=deep, source="guided_json"))
    assert info.value.param == "guided_json" and "recursion limit" in str(info.value)


def test_random_weights_under_tools_with_a_format_call_or_answer_validly(tiny: LLM) -> None:
    """tool_choice auto with a response format: whichever branch a random model takes, the finished
    reply is tool calls with valid arguments or an answer that validates against the schema."""
    params_schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    answer_schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["a", "b"]}},
        "required": ["ok", "pick"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "count", "parameters": params_schema}}
    plan = plan_tool_use(
        [tool], "auto", None, None, answer=StructuredOutputs(json=json.dumps(answer_schema))
    )
    params = [
        SamplingParams(
            max_tokens=80, temperature=1.0, seed=seed, structured_outputs=plan.constraint
        )
        for seed in range(8)
    ]
    outs = [o.outputs[0] for o in tiny.generate(["q"] * len(params), params)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= len(outs) // 2, [o.text for o in outs]
    for out in finished:
        parsed = plan.parser.parse(out.text)
        if parsed.tool_calls:
            assert parsed.content is None
            for call in parsed.tool_calls:
                assert call.name == "count"
                jsonschema.validate(json.loads(call.arguments), params_schema)
        else:
            jsonschema.validate(json.loads(out.text), answer_schema)
