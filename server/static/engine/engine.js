// kvserve live engine page: reads /engine/stream (server-sent events, at most ~10 a second) and draws the
// step timeline, the KV block grid, the request table and the totals. No dependencies, no build step.
"use strict";
(() => {
  const MAX_STEPS = 120; // steps the timeline shows
  const RATE_WINDOW = 3; // seconds the token rates average over
  const MAX_ROWS = 100; // request rows drawn (the rest are counted)
  const STATES = { ".": "free", c: "cached", h: "held", s: "shared" };
  const css = getComputedStyle(document.documentElement);
  const COLORS = {};
  for (const name of ["free", "cached", "held", "shared", "hl"]) COLORS[name] = css.getPropertyValue("--" + name).trim();
  const $ = (id) => document.getElementById(id);
  const fmt = (x, d = 1) => (x == null || !isFinite(x) ? "–" : x.toFixed(d));

  const page = {
    snap: null, steps: [], rates: [], layout: null, holders: new Map(),
    hoverSeqs: new Set(), pinned: null, errors: [],
  };
  window.enginePage = page; // for tests and the curious: the latest data and the grid geometry

  // -- stream ---------------------------------------------------------------------------------------
  const key = new URLSearchParams(location.search).get("api_key");
  const url = "/engine/stream" + (key ? "?api_key=" + encodeURIComponent(key) : "");
  function connect() {
    const es = new EventSource(url);
    es.onopen = () => setStatus("live", "live");
    es.onerror = () => setStatus("down", "reconnecting…");
    es.addEventListener("error", (ev) => { if (ev.data) setStatus("down", JSON.parse(ev.data).message); });
    es.onmessage = (ev) => update(JSON.parse(ev.data));
  }
  function setStatus(cls, text) { const el = $("status"); el.className = "status " + cls; el.textContent = text; }

  function update(snap) {
    page.snap = snap;
    const last = page.steps.length ? page.steps[page.steps.length - 1][0] : 0;
    for (const s of snap.steps) if (s[0] > last) page.steps.push(s);
    if (page.steps.length > MAX_STEPS) page.steps.splice(0, page.steps.length - MAX_STEPS);
    page.holders = new Map();
    for (const [seq, blocks] of Object.entries(snap.kv.tables))
      for (const b of blocks) { const h = page.holders.get(b); h ? h.push(seq) : page.holders.set(b, [seq]); }
    drawTotals(snap); drawTimeline(snap); drawGrid(); drawRequests(snap);
  }

  // -- totals ---------------------------------------------------------------------------------------
  function drawTotals(snap) {
    const t = snap.totals;
    page.rates.push([snap.time, t.num_prompt_tokens, t.num_generation_tokens]);
    while (page.rates.length > 2 && snap.time - page.rates[0][0] > RATE_WINDOW) page.rates.shift();
    const first = page.rates[0], dt = snap.time - first[0];
    $("t-in").textContent = dt > 0 ? fmt((t.num_prompt_tokens - first[1]) / dt) : "–";
    $("t-out").textContent = dt > 0 ? fmt((t.num_generation_tokens - first[2]) / dt) : "–";
    $("t-hit").textContent = t.prefix_cache_queries ? fmt((100 * t.prefix_cache_hits) / t.prefix_cache_queries) + "%" : "–";
    $("t-kv").textContent = fmt(100 * snap.kv.usage) + "%";
    $("t-steps").textContent = snap.num_steps;
    $("t-pre").textContent = t.num_preemptions;
    $("t-fin").textContent = t.num_finished;
    const tiers = snap.kv_offload;
    $("c-tiers").hidden = !tiers;
    if (tiers) {  // [bytes, capacity, blocks, hits] per tier
      const mib = (b) => fmt(b / 1048576), tier = ([used, cap, n, hits]) => cap ? `${mib(used)}/${mib(cap)} MiB (${n} blocks, ${hits} hits)` : "off";
      $("t-tiers").textContent = `${tier(tiers.memory)} · ${tier(tiers.disk)}`;
      $("t-tiers").title = `blocks no tier held: ${tiers.misses}`;
    }
    const ev = snap.kv_events;  // --kv-events-config: events published, where, dropped batches
    $("t-events-card").hidden = !ev;
    if (ev) {
      $("t-events").textContent = ev.num_events + (ev.num_dropped ? " (" + ev.num_dropped + " dropped)" : "");
      $("t-events").title = ev.endpoint + (ev.replay_endpoint ? ", replay " + ev.replay_endpoint : "") + (ev.alive ? "" : " (stopped)");
    }
  }

  // -- timeline -------------------------------------------------------------------------------------
  function drawTimeline(snap) {
    const svg = $("timeline"), steps = page.steps, W = MAX_STEPS * 10, H = 100;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const budget = snap.config.token_budget || 1;
    const top = Math.max(budget, ...steps.map((s) => s[2] + s[3]));
    const maxDur = Math.max(1e-6, ...steps.map((s) => s[1]));
    const y = (tokens) => H - (H - 8) * (tokens / top);
    const parts = [`<line class="budget" x1="0" x2="${W}" y1="${y(budget)}" y2="${y(budget)}"></line>`];
    const x0 = W - steps.length * 10;
    const dur = [];
    steps.forEach((s, i) => {
      const [step, d, prefill, decode, pre] = s, x = x0 + i * 10;
      const drafts = s[7] || 0, accepted = s[8] || 0, chunk = prefill - drafts; // drafts: among prefill
      parts.push(`<g class="step${drafts ? " verify" : ""}" data-step="${step}" data-prefill="${prefill}" data-decode="${decode}" data-drafts="${drafts}" data-accepted="${accepted}">` +
        `<rect class="decode" x="${x + 1}" width="8" y="${y(decode)}" height="${H - y(decode)}"></rect>` +
        (drafts ? `<rect class="draft" x="${x + 1}" width="8" y="${y(decode + drafts)}" height="${y(decode) - y(decode + drafts)}"></rect>` : "") +
        `<rect class="prefill" x="${x + 1}" width="8" y="${y(decode + drafts + chunk)}" height="${y(decode + drafts) - y(decode + drafts + chunk)}"></rect>` +
        (pre ? `<rect class="pre" x="${x + 1}" width="8" y="0" height="5"></rect>` : "") +
        (drafts ? `<rect class="accepted" x="${x + 1}" width="${(8 * accepted) / drafts}" y="${pre ? 5 : 0}" height="4"></rect>` : "") +
        `<title>step ${step}: ${decode} decode + ${prefill} prefill of ${budget} budget; ${fmt(d * 1000, 2)} ms` +
        (pre ? `; ${pre} preempted` : "") +
        (drafts ? `; verification: ${accepted} of ${drafts} draft tokens accepted` : "") + "</title></g>");
      dur.push(`${x + 5},${H - (H - 8) * (d / maxDur)}`);
    });
    if (dur.length) parts.push(`<polyline class="dur" points="${dur.join(" ")}"></polyline>`);
    svg.innerHTML = parts.join("");
    const s = steps[steps.length - 1];
    $("step-info").textContent = s
      ? `last step ${s[0]}: ${s[3]} decode + ${s[2]} prefill / ${budget} budget, ${fmt(s[1] * 1000, 2)} ms (max ${fmt(maxDur * 1000, 2)} ms shown)`
      : "";
  }

  // -- KV block grid --------------------------------------------------------------------------------
  const canvas = $("blocks"), ctx = canvas.getContext("2d");
  function gridLayout(numBlocks) {
    const width = canvas.clientWidth || 800;
    for (const cell of [14, 10, 8, 6, 5, 4]) {
      const cols = Math.floor(width / cell), rows = Math.ceil(numBlocks / cols);
      if (rows <= 60) return { cell, cols, rows, perCell: 1, width };
    }
    // Too many to draw one by one: each cell stands for perCell consecutive blocks.
    const cell = 6, cols = Math.floor(width / cell), maxCells = cols * 60;
    const perCell = Math.ceil(numBlocks / maxCells);
    return { cell, cols, rows: Math.ceil(numBlocks / perCell / cols), perCell, width };
  }
  page.cellRect = (blockId) => {
    const L = page.layout, i = Math.floor(blockId / L.perCell);
    return { x: (i % L.cols) * L.cell, y: Math.floor(i / L.cols) * L.cell, size: L.cell };
  };
  function highlighted() {
    const seqs = new Set(page.hoverSeqs);
    if (page.pinned) for (const seq of Object.keys(page.snap.kv.tables)) if (seq.startsWith(page.pinned + "/")) seqs.add(seq);
    return seqs;
  }
  function drawGrid() {
    const snap = page.snap; if (!snap) return;
    const states = snap.kv.states, n = states.length, L = (page.layout = gridLayout(n));
    const dpr = window.devicePixelRatio || 1;
    canvas.style.height = L.rows * L.cell + "px";
    canvas.width = Math.round(L.width * dpr); canvas.height = Math.round(L.rows * L.cell * dpr);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const counts = { free: 0, cached: 0, held: 0, shared: 0 };
    for (let b = 0; b < n; b++) counts[STATES[states[b]]]++;
    const gap = L.cell >= 6 ? 1 : 0, size = L.cell - gap;
    const numCells = Math.ceil(n / L.perCell);
    for (let i = 0; i < numCells; i++) {
      const x = (i % L.cols) * L.cell, y = Math.floor(i / L.cols) * L.cell;
      if (L.perCell === 1) { ctx.fillStyle = COLORS[STATES[states[i]]]; ctx.fillRect(x, y, size, size); continue; }
      // Aggregated cell: stacked shares of each state, busiest on top.
      const c = { free: 0, cached: 0, held: 0, shared: 0 }, end = Math.min(n, (i + 1) * L.perCell);
      for (let b = i * L.perCell; b < end; b++) c[STATES[states[b]]]++;
      let top = y; const total = end - i * L.perCell;
      for (const name of ["shared", "held", "cached", "free"]) {
        const h = (size * c[name]) / total; if (!h) continue;
        ctx.fillStyle = COLORS[name]; ctx.fillRect(x, top, size, h); top += h;
      }
    }
    const seqs = highlighted();
    if (seqs.size) {
      ctx.strokeStyle = COLORS.hl; ctx.lineWidth = 1.5;
      for (const seq of seqs) for (const b of snap.kv.tables[seq] || []) {
        const r = page.cellRect(b); ctx.strokeRect(r.x + 0.75, r.y + 0.75, size - 1.5, size - 1.5);
      }
    }
    $("n-free").textContent = counts.free; $("n-cached").textContent = counts.cached;
    $("n-held").textContent = counts.held; $("n-shared").textContent = counts.shared;
    page.counts = counts;
    $("kv-caption").textContent = `${n} blocks × ${snap.config.block_size} tokens` +
      (L.perCell > 1 ? `; each cell aggregates ${L.perCell} blocks (stacked shares)` : "; hover a block for its holders, click a request to highlight its blocks");
  }
  canvas.addEventListener("mousemove", (ev) => {
    const snap = page.snap, L = page.layout; if (!snap || !L) return;
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / L.cell), row = Math.floor((ev.clientY - rect.top) / L.cell);
    const first = (row * L.cols + col) * L.perCell;
    if (col >= L.cols || first >= snap.kv.states.length) return hideTip();
    const last = Math.min(snap.kv.states.length, first + L.perCell) - 1;
    const seqs = new Set(), lines = [];
    const c = { free: 0, cached: 0, held: 0, shared: 0 };
    for (let b = first; b <= last; b++) { c[STATES[snap.kv.states[b]]]++; for (const s of page.holders.get(b) || []) seqs.add(s); }
    lines.push(first === last ? `block ${first}: ${STATES[snap.kv.states[first]]}` : `blocks ${first}–${last}: ` +
      Object.entries(c).filter(([, v]) => v).map(([k, v]) => `${v} ${k}`).join(", "));
    const names = [...seqs];
    if (names.length) lines.push("held by " + names.slice(0, 12).join(", ") + (names.length > 12 ? ` and ${names.length - 12} more` : ""));
    const tip = $("tooltip"); tip.hidden = false; tip.textContent = lines.join("\n");
    tip.style.left = Math.min(ev.clientX - rect.left + 12, rect.width - 200) + "px";
    tip.style.top = ev.clientY - rect.top + 12 + "px";
    page.hoverSeqs = seqs; drawGrid();
  });
  function hideTip() { $("tooltip").hidden = true; if (page.hoverSeqs.size) { page.hoverSeqs = new Set(); drawGrid(); } }
  canvas.addEventListener("mouseleave", hideTip);
  window.addEventListener("resize", drawGrid);

  // -- requests -------------------------------------------------------------------------------------
  function drawRequests(snap) {
    const q = snap.queue, cfg = snap.config, tables = snap.kv.tables;
    const blocksOf = new Map();
    for (const [seq, blocks] of Object.entries(tables)) {
      const id = seq.slice(0, seq.lastIndexOf("/")); blocksOf.set(id, (blocksOf.get(id) || 0) + blocks.length);
    }
    const rows = snap.requests.slice().sort((a, b) => (a[1] === "running" ? 0 : 1) - (b[1] === "running" ? 0 : 1) || b[7] - a[7]);
    const html = rows.slice(0, MAX_ROWS).map((r) => {
      const [id, state, n, prompt, computed, cached, out, age, lora] = r;
      const done = Math.min(computed, prompt), pct = prompt ? (100 * done) / prompt : 100;
      return `<tr data-request="${esc(id)}" class="${page.pinned === id ? "hl" : ""}"><td>${esc(id)}${n > 1 ? ` ×${n}` : ""}</td>` +
        `<td class="state-${state}">${state}</td><td>${lora == null ? "base" : esc(lora)}</td><td><span class="prog"><i style="width:${pct}%"></i></span>${done}/${prompt}</td>` +
        `<td>${cached}</td><td>${out}</td><td>${blocksOf.get(id) || 0}</td><td>${fmt(age)}</td></tr>`;
    });
    $("requests").tBodies[0].innerHTML = html.join("");
    $("more-requests").textContent = rows.length > MAX_ROWS ? `and ${rows.length - MAX_ROWS} more` : "";
    $("queue-caption").textContent = `${q.num_requests_running} running (${q.num_running} of ${cfg.max_num_seqs || "?"} sequence slots), ${q.num_requests_waiting} waiting`;
    const maxReq = cfg.max_queued_requests, maxTok = cfg.max_queued_tokens;
    $("q-req").style.width = Math.min(100, (100 * q.num_requests_waiting) / maxReq) + "%";
    $("q-req-text").textContent = `${q.num_requests_waiting} / ${maxReq} requests`;
    $("q-tok").style.width = maxTok ? Math.min(100, (100 * q.num_waiting_tokens) / maxTok) + "%" : "0";
    $("q-tok-text").textContent = `${q.num_waiting_tokens} / ${maxTok == null ? "∞" : maxTok} prompt tokens`;
  }
  $("requests").tBodies[0].addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr"); if (!tr) return;
    page.pinned = page.pinned === tr.dataset.request ? null : tr.dataset.request;
    for (const row of $("requests").tBodies[0].rows) row.classList.toggle("hl", row.dataset.request === page.pinned);
    drawGrid();
  });
  function esc(s) { return String(s).replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`); }

  connect();
})();
