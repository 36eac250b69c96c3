"""The cost sheet is one shared piece: every generating surface adds it when asked (field or header),
and only then; on a fake engine, so the shape is checked without a model."""

from __future__ import annotations

import httpx
import pytest

from server.app import build_app
from server.state import ServerConfig
from tests.unit.server_fakes import FakeEngine

CHAT = [{"role": "user", "content": "abc"}]
BODIES = {
    "/v1/completions": {"prompt": "abc", "max_tokens": 4},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 4},
    "/v1/messages": {"messages": CHAT, "max_tokens": 4},
    "/v1/responses": {"input": "abc", "max_output_tokens": 4},
}


@pytest.mark.parametrize("route", list(BODIES))
async def test_every_surface_adds_the_cost_sheet_when_asked(route: str) -> None:
    app = build_app(ServerConfig(), FakeEngine())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        plain = await c.post(route, json=BODIES[route])
        assert plain.status_code == 200, plain.text
        assert "metrics" not in plain.json()
        asked = await c.post(route, json={**BODIES[route], "return_metrics": True})
        by_header = await c.post(route, json=BODIES[route], headers={"X-KVServe-Metrics": "1"})
        for r in (asked, by_header):
            assert r.status_code == 200, r.text
            m = r.json()["metrics"]
            assert m["num_prompt_tokens"] > 0
            assert (
                m["num_computed_prompt_tokens"] == m["num_prompt_tokens"] - m["num_cached_tokens"]
            )
        bad = await c.post(route, json={**BODIES[route], "return_metrics": "maybe"})
        assert bad.status_code == 400
