"""Regexes as JSON Schema and the OpenAI API mean them. JSON Schema's `pattern` is an ECMA-262
regex, where `\\d` is [0-9], `\\w` is [0-9A-Za-z_] and `\\s` is ECMA's own whitespace list;
llguidance's (Rust) regex engine reads them as Unicode classes, so a `\\d{3}` pattern could be met
with Arabic-Indic digits and `\\s` with U+0085. These rewrite the class escapes, `.` and `\\cX` to
their ECMA meaning before a pattern reaches llguidance, and tell which escapes and groups ECMA-262
(with the `u` flag, as JSON Schema 2020-12 reads patterns) does not have, so that a schema using
them is refused rather than read with another dialect's meaning."""

from __future__ import annotations

from typing import Any

# ECMA-262 WhiteSpace and LineTerminator: U+FEFF in, U+0085 out (Unicode's White_Space: the reverse).
_WS = (
    r"\t\n\x0B\x0C\r \xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
)
# Class escapes outside a bracket class, and inside one ([\\d.] -> [0-9.]; [^\\D] uses a POSIX class).
_OUTSIDE = {
    "d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]",
    "s": f"[{_WS}]", "S": f"[^{_WS}]",
}  # fmt: skip
_INSIDE = {
    "d": "0-9", "D": "[:^digit:]", "w": "0-9A-Za-z_", "W": "[:^word:]",
    "s": _WS, "S": f"[^{_WS}]",  # a nested class: llguidance's syntax has them
}  # fmt: skip
# Escapes ECMA-262 has with the u flag: classes, controls, \cX, \xHH, \uHHHH / \u{..}, \p{..},
# \k<name>, \0 and back-references, word boundaries, and escaped syntax characters.
_ECMA_LETTERS = set("dDwWsSbBfnrtvcxupPk")
_ECMA_SYNTAX = set("^$\\.*+?()[]{}|/-0123456789")

# Keywords whose value maps names to subschemas (names are not patterns, except patternProperties').
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required", "description", "title")


# ECMA's `.` (no `s` flag) matches anything but its four line terminators; Rust's only skips \n.
_DOT = r"[^\n\r\x{2028}\x{2029}]"


def ecma_regex(pattern: str) -> str:
    """`pattern` with the class escapes (`\\d \\D \\w \\W \\s \\S`), `.` and `\\cX` given their
    ECMA-262 meaning in llguidance's syntax; everything else (escaped backslashes, `\\p{..}`, POSIX
    classes, other escapes) is kept as written."""
    out: list[str] = []
    depth = 0  # bracket-class nesting (llguidance's syntax allows [a[b]])
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e == "c" and i + 2 < n and pattern[i + 2].isascii() and pattern[i + 2].isalpha():
                out.append(f"\\x{{{ord(pattern[i + 2]) % 32:02X}}}")  # \cJ: the control J, \n
                i += 3
                continue
            table = _INSIDE if depth else _OUTSIDE
            out.append(table.get(e, c + e))
            i += 2
            continue
        if c == "." and not depth:
            out.append(_DOT)
            i += 1
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


def ecma_patterns(schema: Any) -> Any:
    """A copy of a JSON schema with every `pattern` and `patternProperties` key passed through
    `ecma_regex` (the input is not modified; values that are data, such as `enum`, are kept)."""
    if isinstance(schema, list):
        return [ecma_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = ecma_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ecma_regex(k): ecma_patterns(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: ecma_patterns(v) for k, v in value.items()}
        elif key in _NOT_SCHEMAS:
            out[key] = value
        else:
            out[key] = ecma_patterns(value)
    return out


def ecma_pattern_error(pattern: str) -> str | None:
    """Why `pattern` is not an ECMA-262 regex in `u` mode, for the escapes and group forms that
    other dialects have (`\\A`, `\\z`, `\\a`, `(?P<n>..)`, `(?i)`); None if it has none of
    those. (Whether the rest compiles is llguidance's to say, when the grammar is built.)"""
    i, n = 0, len(pattern)
    depth = 0
    while i < n:
        c = pattern[i]
        if c == "[":
            if depth and pattern.startswith("[:", i):
                return "POSIX classes such as [:alpha:] are not ECMA-262"
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        elif not depth and c in "*+?}" and pattern.startswith("+", i + 1):
            return f"{c}+ (a possessive quantifier) is not ECMA-262"
        if c == "\\":
            if i + 1 >= n:
                return "it ends with a lone backslash"
            e = pattern[i + 1]
            if e.isalnum() and e not in _ECMA_LETTERS and not e.isdigit():
                return f"\\{e} is not an ECMA-262 escape"
            if not e.isalnum() and e not in _ECMA_SYNTAX:
                return f"\\{e} is not an ECMA-262 escape (with the u flag)"
            i += 2
            continue
        if c == "(" and not depth and pattern.startswith("(?", i):
            rest = pattern[i + 2 : i + 4]
            if not (rest[:1] in (":", "=", "!") or rest in ("<=", "<!") or _named_group(rest)):
                return f"{pattern[i : i + 4]!r} is not an ECMA-262 group"
        i += 1
    return None


def _named_group(rest: str) -> bool:
    return len(rest) == 2 and rest[0] == "<" and (rest[1].isalpha() or rest[1] in "_$")
