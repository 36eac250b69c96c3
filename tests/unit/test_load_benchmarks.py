"""The mixed-load and neighbours benchmarks' pure parts: the same seeded requests for every variant,
the issue's request mix and prompt lengths, variant parsing, the latency summary."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.mixed_load import KINDS, Result, _body, make_requests, parse_variant, summarize
from benchmarks.neighbours import parse_variant as parse_neighbour_variant


def test_requests_are_seeded_and_cover_the_mix() -> None:
    a, b = make_requests(200, seed=3), make_requests(200, seed=3)
    assert a == b and make_requests(200, seed=4) != a  # every variant gets the same round
    assert {r.kind for r in a} == set(KINDS)
    words = [len(r.prompt.split()) for r in a]
    assert 20 <= min(words) and max(words) <= 400


def test_bodies_per_kind() -> None:
    by_kind = {r.kind: r for r in make_requests(200, seed=1)}
    assert _body(by_kind["score"])[0] == "/v1/score"
    path, body = _body(by_kind["json_schema"])
    assert path == "/v1/chat/completions" and body["response_format"]["type"] == "json_schema"
    assert _body(by_kind["tool"])[1]["tool_choice"] == "required"
    assert "prompt" in _body(by_kind["plain"])[1]


def test_summary_pools_gaps_and_tokens_over_rounds() -> None:
    rounds = [
        {"seconds": 2.0, "results": [Result("stream", True, 10, 0.5, [0.1] * 98 + [1.0, 2.0])]},
        {"seconds": 2.0, "results": [Result("plain", True, 30), Result("chat", False, error="x")]},
    ]
    s = summarize(rounds)
    assert s["output_tokens"] == 40 and s["tokens_per_s"] == 10.0 and s["errors"] == 1
    assert s["itl_max_ms"] == 2000.0 and s["itl_p99_ms"] == 2000.0 and s["itl_p50_ms"] == 100.0
    assert s["tokens_per_s_rounds"] == [5.0, 15.0]


def test_variants_parse() -> None:
    assert parse_variant("step=--target-step-ms 200") == ("step", "--target-step-ms 200")
    assert parse_variant("fixed=") == ("fixed", "")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant("no-equals-sign")
    assert parse_neighbour_variant("p=OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=0 --threads 1") == (
        "p",
        {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
        ["--threads", "1"],
    )
