"""Regexes as JSON Schema and the OpenAI API mean them. JSON Schema's `pattern` is an ECMA-262
regex, where `\\d` is [0-9] and `\\w` is [0-9A-Za-z_]; llguidance's regex engine reads them as
Unicode classes, so a `\\d{3}` pattern could be met with Arabic-Indic or Devanagari digits. These
rewrite the four classes to their ASCII meaning before a pattern reaches llguidance (`\\s` is
left as written: ECMA's `\\s` is Unicode whitespace too)."""

from __future__ import annotations

from typing import Any

# Outside a bracket class, and inside one ([\\d.] -> [0-9.]; [^\\D] uses a POSIX class there).
_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
_INSIDE = {"d": "0-9", "D": "[:^digit:]", "w": "0-9A-Za-z_", "W": "[:^word:]"}

# Keywords whose value maps names to subschemas (names are not patterns, except patternProperties').
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "description", "title")


def ascii_regex(pattern: str) -> str:
    """`pattern` with `\\d \\D \\w \\W` replaced by their ASCII classes; everything else (escaped
    backslashes, `\\p{..}`, POSIX classes, other escapes) is kept as written."""
    out: list[str] = []
    depth = 0  # bracket-class nesting (llguidance's syntax allows [a[b]])
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            table = _INSIDE if depth else _OUTSIDE
            out.append(table.get(e, c + e))
            i += 2
            continue
        if c == "[":
            if depth and pattern.startswith("[:", i):  # a POSIX class such as [:alpha:]
                end = pattern.find(":]", i + 2)
                if end != -1:
                    out.append(pattern[i : end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            # A `]` (after an optional `^`) first in a class is a literal one.
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def ascii_patterns(schema: Any) -> Any:
    """A copy of a JSON schema with every `pattern` and `patternProperties` key passed through
    `ascii_regex` (the input is not modified; values that are data, such as `enum`, are kept)."""
    if isinstance(schema, list):
        return [ascii_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ascii_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ascii_regex(k): ascii_patterns(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: ascii_patterns(v) for k, v in value.items()}
        elif key in _NOT_SCHEMAS:
            out[key] = value
        else:
            out[key] = ascii_patterns(value)
    return out
