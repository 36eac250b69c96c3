"""response_format (OpenAI) and structured_outputs (vLLM) -> the engine's StructuredOutputs; JSON
schemas are checked here so that a bad one is a 400 naming its field."""

from __future__ import annotations

import functools
import json
from typing import Any

from engine import StructuredOutputs
from engine.text import ecma_pattern_error
from server.errors import invalid_request
from server.field_map import FieldMap
from server.protocol import (
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingFields,
    StructuredOutputsRequest,
)


@functools.cache
def _format_checker() -> Any:
    """The metaschema's format checks, with `regex` (a `pattern`, a `patternProperties` key) judged
    as ECMA-262 rather than Python's `re`: `(?<y>..)` and `\\p{Lu}` are valid, `(?P<y>..)` is not.
    Built once: it only reads its table."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    checker.checkers = {**checker.checkers, "regex": (_is_ecma_regex, ValueError)}
    return checker


def _is_ecma_regex(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    why = ecma_pattern_error(instance)
    if why is not None:
        raise ValueError(why)
    return True


def check_json_schema(schema: Any, param: str) -> str:
    """The schema as canonical JSON text; an invalid JSON schema is a 400 naming `param`."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise invalid_request("a JSON schema must be a JSON object", param)
    try:
        validator = jsonschema.validators.validator_for(schema)
        validator.check_schema(schema, format_checker=_format_checker())
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        why = f"{e.message} ({e.cause})" if e.cause is not None else e.message
        raise invalid_request(f"invalid JSON schema at {where}: {why}", param) from None
    except RecursionError:  # jsonschema walks the schema recursively
        raise invalid_request("the JSON schema nests too deeply to be checked", param) from None
    return json.dumps(schema, sort_keys=True)


def request_constraint(req: SamplingFields, fields: FieldMap) -> StructuredOutputs | None:
    """The constraint a request asks for, or None; both fields at once is a 400. Its `source` is the
    request field it came from (the engine's label for it; errors name it through `fields`)."""
    rf, so = req.response_format, req.structured_outputs
    from_format = _from_response_format(rf, fields)
    from_so = _from_structured_outputs(so) if so is not None else None
    guided = _guided_request(req)
    from_guided = _from_structured_outputs(guided, "guided_") if guided is not None else None
    given = [
        name
        for name, c in (
            ("response_format", from_format),
            ("structured_outputs", from_so),
            (from_guided.source if from_guided is not None else "", from_guided),
        )
        if c is not None
    ]
    if len(given) > 1:
        raise invalid_request(f"{' and '.join(given)} conflict: give only one of them", given[-1])
    return from_format or from_so or from_guided


def _guided_request(req: SamplingFields) -> StructuredOutputsRequest | None:
    """vLLM's guided_* fields as the structured_outputs request they spell (None: none given)."""
    fields = (req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    if all(f is None for f in fields):
        if req.guided_whitespace_pattern is not None:
            raise invalid_request(
                "guided_whitespace_pattern needs guided_json", "guided_whitespace_pattern"
            )
        return None
    return StructuredOutputsRequest(
        json=req.guided_json,
        regex=req.guided_regex,
        choice=req.guided_choice,
        grammar=req.guided_grammar,
        whitespace_pattern=req.guided_whitespace_pattern,
    )


JSON_OBJECT = StructuredOutputs(json_object=True, source="response_format")


def json_schema_constraint(schema: Any, fields: FieldMap) -> StructuredOutputs:
    """An answer that follows the JSON `schema` (chat's response_format.json_schema; Responses'
    text.format and Messages' output format name it through `fields`)."""
    source = "response_format.json_schema.schema"
    return StructuredOutputs(json=check_json_schema(schema, fields.name(source)), source=source)


def _from_response_format(rf: Any, fields: FieldMap) -> StructuredOutputs | None:
    if isinstance(rf, ResponseFormatJsonObject):
        return JSON_OBJECT
    if isinstance(rf, ResponseFormatJsonSchema):
        schema = rf.json_schema.json_schema
        if schema is None:
            raise invalid_request(
                "json_schema needs a schema", fields.name("response_format.json_schema.schema")
            )
        return json_schema_constraint(schema, fields)
    return None  # text, or absent


def _from_structured_outputs(
    so: StructuredOutputsRequest, prefix: str = "structured_outputs."
) -> StructuredOutputs | None:
    """`prefix` spells a constraint's field: structured_outputs.json, or vLLM's guided_json."""
    whole = "structured_outputs" if prefix.endswith(".") else prefix + "json"
    given = [
        name
        for name, value in (
            ("json", so.json_schema),
            ("json_object", so.json_object or None),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
        )
        if value is not None
    ]
    if not given:
        if so.whitespace_pattern is not None:
            raise invalid_request(
                "whitespace_pattern needs a json or json_object constraint", whole
            )
        raise invalid_request(
            "structured_outputs takes one constraint: json, json_object, regex, choice or grammar",
            whole,
        )
    if len(given) > 1:
        names = " and ".join(prefix + g for g in given)
        raise invalid_request(f"give only one constraint, got {names}", whole)
    kind = given[0]
    param = prefix + kind
    schema = None
    if so.json_schema is not None:
        value = so.json_schema
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise invalid_request(f"the JSON schema is not valid JSON: {e}", param) from None
        schema = check_json_schema(value, param)
    if so.whitespace_pattern is not None and kind not in ("json", "json_object"):
        raise invalid_request(
            "whitespace_pattern applies only to json and json_object constraints",
            prefix + "whitespace_pattern",
        )
    if so.choice is not None and not all(so.choice):
        raise invalid_request("choice entries must be non-empty strings", param)
    return StructuredOutputs(
        json=schema,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=tuple(so.choice) if so.choice is not None else None,
        grammar=so.grammar,
        whitespace_pattern=so.whitespace_pattern,
        source=param,
    )
