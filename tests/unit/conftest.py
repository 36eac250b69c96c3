"""Fixtures of the server tests: a fake engine, and an HTTP client of the app over it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.unit.server_fakes import FakeEngine, app_client


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine) as c:
        yield c
