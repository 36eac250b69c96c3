"""The live /engine page in a real headless Chromium (the system `chromium`, driven by Playwright; no
browser download) against a real server running a shared-prefix workload: the timeline grows, blocks
two requests share are drawn shared, a finished request's blocks turn cached-free, no console errors.
A screenshot is saved to tests/artifacts/engine_page.png."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT, ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LAUNCH_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = REPO_ROOT / "tests" / "artifacts"
KEY = "page-secret"
PREFIX = list(range(1000, 1064))  # 64 tokens = 4 full blocks every request shares

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no system chromium (apt-get install -y chromium)"
)


@pytest.fixture(scope="module")
def page_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "192",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--log-level", "warning",
        "--api-key", KEY,
    ]  # fmt: skip
    server = ServerProcess(tiny_llama_dir, args, tmp_path_factory.mktemp("logs") / "page.log")
    server.wait_ready()
    yield server
    server.stop()


def _complete(url: str, suffix: int, max_tokens: int) -> None:
    body = {
        "prompt": PREFIX + [2000 + suffix] * 8,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    r.raise_for_status()


LAST_STEP = (
    "Math.max(0, ...[...document.querySelectorAll('#timeline g.step')].map(g => +g.dataset.step))"
)

# Reads the canvas pixel at the middle of a block's cell and names its state by the page's colours.
PIXEL_STATE = """(blockId) => {
  const page = window.enginePage, canvas = document.getElementById('blocks');
  const r = page.cellRect(blockId), dpr = window.devicePixelRatio || 1;
  const px = canvas.getContext('2d').getImageData(
    Math.floor((r.x + r.size / 2) * dpr), Math.floor((r.y + r.size / 2) * dpr), 1, 1).data;
  const css = getComputedStyle(document.documentElement);
  const probe = document.createElement('canvas').getContext('2d');
  for (const name of ['free', 'cached', 'held', 'shared']) {
    probe.fillStyle = css.getPropertyValue('--' + name).trim();
    probe.fillRect(0, 0, 1, 1);
    const c = probe.getImageData(0, 0, 1, 1).data;
    if (Math.abs(c[0] - px[0]) + Math.abs(c[1] - px[1]) + Math.abs(c[2] - px[2]) < 12) return name;
  }
  return 'rgb(' + px[0] + ',' + px[1] + ',' + px[2] + ')';
}"""


# The first block whose state is shared, with its holders and the colour drawn for it, all read in one
# frame; null (keep waiting) while none is. An array, never a bare id: block 0 would read as "not yet".
SHARED_BLOCK = f"""() => {{
  const page = window.enginePage, states = page.snap ? page.snap.kv.states : "";
  for (let i = 0; i < states.length; i++) {{
    const holders = page.holders.get(i) || [];
    if (states[i] === 's' && holders.length > 1) return [i, holders, ({PIXEL_STATE})(i)];
  }}
  return null;
}}"""


def test_engine_page_shows_steps_shared_blocks_and_cached_free(page_server: ServerProcess) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    ARTIFACTS.mkdir(exist_ok=True)
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{page_server.url}/engine?api_key={KEY}")
            page.wait_for_function("window.enginePage && window.enginePage.snap !== null")

            # One request computes the prefix and registers its blocks; the others then share them.
            _complete(page_server.url, 0, 1)
            workers = [
                threading.Thread(target=_complete, args=(page_server.url, i, 200))
                for i in range(1, 7)
            ]
            for w in workers:
                w.start()
            # One read of one snapshot: a block drawn shared whose holders name several sequences (the
            # page redraws between two evaluate calls, so state, holders and pixel are read together).
            found = page.wait_for_function(SHARED_BLOCK, timeout=60_000).json_value()
            steps_seen = page.evaluate(LAST_STEP)
            block, holders, pixel = found
            assert len(holders) > 1, holders  # a shared block names several holders
            assert pixel == "shared", found
            page.wait_for_timeout(500)  # a few more updates: the timeline has moved on
            page.screenshot(path=str(ARTIFACTS / "engine_page.png"), full_page=True)
            for w in workers:
                w.join(timeout=300)

            # Finished: the prefix blocks are free but keep their content for the next prefix hit.
            page.wait_for_function(
                f"window.enginePage.snap.kv.states[{block}] === 'c' && "
                "window.enginePage.snap.requests.length === 0",
                timeout=30_000,
            )
            page.wait_for_timeout(300)  # one more frame drawn
            assert page.evaluate(PIXEL_STATE, block) == "cached"
            assert page.evaluate(LAST_STEP) > steps_seen > 0
            assert page.locator("#t-steps").inner_text() != "–"
            assert float(page.locator("#t-hit").inner_text().rstrip("%")) > 0
        finally:
            browser.close()
    assert errors == []


def test_engine_page_needs_the_key(page_server: ServerProcess) -> None:
    for path in ("/engine", "/engine/stream", "/engine/static/engine.js"):
        r = httpx.get(page_server.url + path, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(page_server.url + "/engine/static/engine.js?api_key=wrong", timeout=10)
    assert r.status_code == 401
    # The key in the query string is only for the page's routes, never for the API.
    r = httpx.get(page_server.url + f"/v1/models?api_key={KEY}", timeout=10)
    assert r.status_code == 401
