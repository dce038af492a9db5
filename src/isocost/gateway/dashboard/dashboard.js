// isocost dashboard: polls GET /admin/snapshot once a second and redraws the page.
// Plain DOM and canvas, no libraries. Text from the gateway is only ever set through
// textContent, never parsed as HTML.
"use strict";

(() => {
  const POLL_MS = 1000;
  const HISTORY_POINTS = 120; // two minutes of samples per replica
  const MAX_DECISIONS = 12;
  const TOKEN_KEY = "isocost.adminToken";
  const PALETTE = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
  ];

  const SLO_WINDOW_S = 60; // attainment over the last minute of verdicts
  const samples = new Map(); // replica name -> {inFlight: [], ttft: []}
  const verdictHistory = new Map(); // pool -> [{t, met, judged}], the last SLO_WINDOW_S
  const colors = new Map(); // replica name -> colour
  let polls = 0;
  let token = null;

  const $ = (selector) => document.querySelector(selector);

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "className") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmt(value, digits = 0) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString(undefined, {
      minimumFractionDigits: digits,
      maximumFractionDigits: digits,
    });
  }

  function colorOf(name) {
    if (!colors.has(name)) colors.set(name, PALETTE[colors.size % PALETTE.length]);
    return colors.get(name);
  }

  // -- token --------------------------------------------------------------------------

  function readToken() {
    const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
    const fromQuery = new URLSearchParams(location.search).get("token");
    const given = fromHash || fromQuery;
    if (given) {
      sessionStorage.setItem(TOKEN_KEY, given);
      // Keep the secret out of the address bar, bookmarks and screenshots.
      window.history.replaceState(null, "", location.pathname);
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function askForToken(message) {
    setStatus("auth", message);
    $("#token-form").hidden = false;
    $("#token-input").focus();
  }

  $("#token-form")?.addEventListener("submit", (event) => {
    event.preventDefault();
    token = $("#token-input").value.trim();
    sessionStorage.setItem(TOKEN_KEY, token);
    $("#token-form").hidden = true;
    poll();
  });

  function setStatus(state, text) {
    const status = $("#status");
    status.dataset.state = state;
    status.dataset.polls = String(polls);
    status.textContent = text;
  }

  // -- polling ------------------------------------------------------------------------

  let timer = null;

  async function poll() {
    clearTimeout(timer);
    if (!token) {
      askForToken("enter the gateway's admin token");
      return;
    }
    try {
      const response = await fetch("/admin/snapshot", {
        headers: { Authorization: `Bearer ${token}` },
        cache: "no-store",
      });
      if (response.status === 401) {
        askForToken("the admin token was refused; enter it again");
        return;
      }
      if (response.status === 403) {
        setStatus("auth", "the admin API is disabled on this gateway (set auth.admin_token)");
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const snapshot = await response.json();
      polls += 1;
      render(snapshot);
      const updated = new Date(snapshot.time_unix_s * 1000).toLocaleTimeString();
      const bus = snapshot.state_bus;
      const shared = bus
        ? ` · state bus ${bus.up ? "up" : "DOWN (scrapes only)"}, ${bus.peers} peer${bus.peers === 1 ? "" : "s"}`
        : "";
      setStatus("live", `live · updated ${updated} · gateway up ${fmt(snapshot.uptime_s)} s${shared}${workersNote(snapshot)}`);
    } catch (error) {
      setStatus("down", `gateway unreachable (${error.message}); retrying`);
    }
    timer = setTimeout(poll, POLL_MS);
  }

  // serve --workers: the snapshot counts the requests of the workers that answered it.
  function workersNote(snapshot) {
    const workers = snapshot.workers;
    if (!workers) return "";
    const missing = workers.missing.length
      ? `, not counted: worker ${workers.missing.join(", ")} (no answer)`
      : "";
    return ` · ${workers.answered.length} workers, answered by ${snapshot.worker}${missing}`;
  }

  // -- rendering ----------------------------------------------------------------------

  function render(snapshot) {
    renderPools(snapshot.pools, snapshot.time_unix_s, snapshot.shadow || {});
    renderAutoscaler(snapshot.autoscaler);
    renderReplicas(snapshot.replicas);
    renderDecisions(snapshot.decisions);
    renderRejections(snapshot.rejections);
    record(snapshot.replicas);
    drawCharts(snapshot.replicas.map((r) => r.name));
  }

  // The share of answers judged in the last SLO_WINDOW_S that met the pool's SLO, from the
  // cumulative verdict counts of successive snapshots; null before any was judged.
  function recentAttainment(pool, now) {
    const v = pool.slo_verdicts;
    const judged = v.met + v.missed + v.failed;
    if (!verdictHistory.has(pool.model)) verdictHistory.set(pool.model, []);
    const history = verdictHistory.get(pool.model);
    history.push({ t: now, met: v.met, judged });
    while (history.length > 1 && history[1].t <= now - SLO_WINDOW_S) history.shift();
    const first = history[0];
    const window = history.length > 1 ? judged - first.judged : judged;
    const met = history.length > 1 ? v.met - first.met : v.met;
    return { share: window > 0 ? met / window : null, window, judged };
  }

  function sloLine(pool, now) {
    if (!pool.slo && pool.slo_verdicts.met + pool.slo_verdicts.missed + pool.slo_verdicts.failed === 0) {
      return [];
    }
    const { share, window, judged } = recentAttainment(pool, now);
    const text = share === null ? "–" : `${fmt(share * 100, 1)} %`;
    return [
      el(
        "div",
        { className: "card-line", title: "answers within the pool's SLO (or their own x-deadline-ms / x-tpot-ms)" },
        "SLO met ",
        el("b", { className: "pool-slo" }, text),
        ` (last min, ${fmt(window)} of ${fmt(judged)} judged)`,
      ),
    ];
  }

  // A signed percentage with a true minus sign: -0.31 -> "−31%", 0.12 -> "+12%".
  function signedPercent(ratio) {
    if (ratio === null || ratio === undefined) return "–";
    const percent = Math.round(ratio * 100);
    return `${percent < 0 ? "\u2212" : "+"}${Math.abs(percent)}%`;
  }

  // One line per candidate policy of the pool's shadow evaluation: its predicted change
  // against the running policy, both replayed in the twin on the recent window.
  function renderShadow(shadow) {
    if (!shadow) return [];
    const replay = shadow.replay;
    const since = replay
      ? ` (replay of ${fmt(replay.requests)} requests, ${fmt(replay.age_s)} s ago)`
      : shadow.last_error
        ? ` (no replay yet: ${shadow.last_error})`
        : " (no replay yet)";
    return shadow.candidates.map((c) =>
      el(
        "div",
        {
          className: "card-line shadow-line",
          dataset: { policy: c.policy },
          title: `agrees with the running policy on ${c.agreement === null ? "–" : fmt(c.agreement * 100) + " %"} of ${fmt(c.decisions)} decisions`,
        },
        "candidate ",
        el("b", {}, c.policy),
        `: P99 TTFT ${signedPercent(c.ttft_p99_change)}, goodput ${signedPercent(c.goodput_change)}`,
        since,
      ),
    );
  }

  // isocost autoscale's last status (POST /admin/autoscaler); stale after 3 intervals.
  function renderAutoscaler(status) {
    const line = $("#autoscaler");
    line.hidden = !status;
    if (!status) return;
    line.dataset.stale = String(status.stale);
    line.replaceChildren(
      `autoscaler${status.dry_run ? " (dry run)" : ""}: desired `,
      el("b", {}, fmt(status.desired)),
      `, ready ${fmt(status.ready)}, pending ${fmt(status.pending)}`,
      status.draining ? `, draining ${fmt(status.draining)}` : "",
      status.ejected ? `, ejected ${fmt(status.ejected)}` : "",
      `, forecast ${fmt(status.forecast_rps, 1)} req/s, ${fmt(status.age_s)} s ago`,
      status.stale ? " (stale)" : "",
    );
  }

  function renderPools(pools, now, shadows) {
    const cards = pools.map((pool) =>
      el(
        "div",
        { className: "card", dataset: { pool: pool.model } },
        el("div", { className: "card-title" }, pool.model),
        el("div", { className: "card-line" }, "policy ", el("b", {}, pool.policy)),
        ...renderShadow(shadows[pool.model]),
        el("div", { className: "card-line" }, `healthy ${pool.healthy} / ${pool.replicas}`),
        el("div", { className: "card-line" }, "in flight ", el("b", { className: "pool-in-flight" }, fmt(pool.in_flight))),
        el("div", { className: "card-line" }, `gateway queue ${fmt(pool.queue_depth)}`),
        ...sloLine(pool, now),
      ),
    );
    $("#pools").replaceChildren(...cards);
  }

  // The prefill terms a replica is priced with (fitted with calibration.prefill_fit):
  // ms per request, per chunk, per 1k tokens and per sequence decoding beside it.
  function prefillTerms(terms) {
    if (!terms) return "–";
    const shown = [terms.request, terms.chunk, terms["1k_tokens"], terms.running];
    return shown.map((v) => fmt(v, 1)).join(" / ");
  }

  const REPLICA_COLUMNS = [
    ["name", (r) => r.name],
    ["gpu", (r) => (r.tensor_parallel > 1 ? `${r.gpu} ×${r.tensor_parallel}` : r.gpu)],
    ["state", (r) => (r.drained_by ? `${r.state} by ${r.drained_by}` : r.state)],
    ["in-flight", (r) => fmt(r.in_flight)],
    ["running", (r) => fmt(r.engine_running)],
    ["waiting", (r) => fmt(r.engine_waiting)],
    ["kv", (r) => (r.kv_usage === null ? "–" : `${fmt(r.kv_usage * 100, 1)} %`)],
    ["ttft-factor", (r) => fmt(r.ttft_factor, 2)],
    ["itl-factor", (r) => fmt(r.itl_factor, 2)],
    ["ttft-error", (r) => (r.ttft_error === null ? "–" : `${fmt(r.ttft_error * 100)} %`)],
    ["itl-error", (r) => (r.itl_error === null ? "–" : `${fmt(r.itl_error * 100)} %`)],
    ["prefill-duty", (r) => (r.prefill_duty === null ? "–" : `${fmt(r.prefill_duty * 100)} %`)],
    ["prefill-terms", (r) => prefillTerms(r.prefill_terms_ms)],
    ["ttft", (r) => fmt(r.recent_ttft_p50_ms)],
    ["itl", (r) => fmt(r.recent_itl_p50_ms, 1)],
    ["last-ttft", (r) => fmt(r.last_ttft_ms)],
    ["success", (r) => `${fmt(r.success_rate * 100)} %`],
    ["divergence", (r) => fmt(r.view_divergence, 1)],
  ];

  function renderReplicas(replicas) {
    const body = $("#replicas tbody");
    const rows = new Map([...body.rows].map((row) => [row.dataset.replica, row]));
    const maxInFlight = Math.max(1, ...replicas.map((r) => r.in_flight));
    replicas.forEach((replica, index) => {
      let row = rows.get(replica.name);
      if (!row) {
        row = el("tr", { dataset: { replica: replica.name } });
        for (const [key] of REPLICA_COLUMNS) row.append(el("td", { className: key }));
        const bar = el("div", { className: "bar" }, el("div", { className: "fill" }));
        row.append(el("td", { className: "load" }, bar));
      }
      rows.delete(replica.name);
      REPLICA_COLUMNS.forEach(([key, value], i) => {
        const text = value(replica);
        if (row.cells[i].textContent !== text) row.cells[i].textContent = text;
      });
      row.cells[0].style.borderLeftColor = colorOf(replica.name);
      row.dataset.state = replica.state;
      row.cells[2].title = replica.last_error || replica.breaker;
      const fill = row.querySelector(".fill");
      fill.style.width = `${(100 * replica.in_flight) / maxInFlight}%`;
      fill.classList.toggle("hot", (replica.engine_waiting || 0) > 0);
      if (body.rows[index] !== row) body.insertBefore(row, body.rows[index] || null);
    });
    for (const stale of rows.values()) stale.remove();
  }

  // What a decision read about a candidate (Explanation.inputs), in the table's words.
  const INPUTS = [
    ["cached_tokens", "cached", 0],
    ["waiting", "queued", 0],
    ["running", "running", 0],
    ["predicted_ttft_ms", "TTFT ms", 1],
  ];

  function describeScores(row) {
    const parts = Object.entries(row)
      .filter(([key]) => key !== "replica_id" && key !== "total" && key !== "inputs")
      .map(([key, value]) => `${key} ${fmt(value, 2)}`);
    const read = INPUTS.filter(([key]) => row.inputs && key in row.inputs).map(
      ([key, label, digits]) => `${label} ${fmt(row.inputs[key], digits)}`,
    );
    const scores = parts.length ? ` (${parts.join(", ")})` : "";
    return `${row.replica_id} ${fmt(row.total, 2)}${scores}${read.length ? `: ${read.join(", ")}` : ""}`;
  }

  function renderDecisions(decisions) {
    const rows = decisions
      .slice(-MAX_DECISIONS)
      .reverse()
      .map((d) =>
        el(
          "tr",
          { dataset: { outcome: d.outcome } },
          el("td", {}, d.policy),
          el("td", {}, d.reason ? `${d.outcome}: ${d.reason}` : d.outcome),
          el("td", { className: "chosen" }, d.replica ?? "–"),
          el("td", {}, fmt(d.prompt_tokens)),
          el("td", {}, fmt(d.cached_tokens)),
          el("td", {}, fmt(d.predicted_ttft_ms)),
          el(
            "td",
            { className: "scores" },
            ...d.scores.slice(0, 3).map((s) => el("div", {}, describeScores(s))),
          ),
        ),
      );
    $("#decisions tbody").replaceChildren(...rows);
  }

  function renderRejections(rejections) {
    const entries = Object.entries(rejections).sort((a, b) => b[1] - a[1]);
    const rows = entries.length
      ? entries.map(([reason, count]) => el("tr", {}, el("td", {}, reason), el("td", {}, fmt(count))))
      : [el("tr", {}, el("td", { colspan: "2", className: "none" }, "none yet"))];
    $("#rejections tbody").replaceChildren(...rows);
  }

  // -- charts -------------------------------------------------------------------------

  function record(replicas) {
    for (const r of replicas) {
      if (!samples.has(r.name)) samples.set(r.name, { inFlight: [], ttft: [] });
      const h = samples.get(r.name);
      h.inFlight.push(r.in_flight);
      h.ttft.push(r.recent_ttft_p50_ms);
      if (h.inFlight.length > HISTORY_POINTS) h.inFlight.shift();
      if (h.ttft.length > HISTORY_POINTS) h.ttft.shift();
    }
  }

  function drawCharts(names) {
    const series = (key) => names.map((n) => ({ color: colorOf(n), values: samples.get(n)[key] }));
    drawLines($("#chart-inflight"), series("inFlight"), { log: false });
    drawLines($("#chart-ttft"), series("ttft"), { log: true });
    const legend = names.map((n) =>
      el("span", { className: "swatch", dataset: { color: colorOf(n) } }, n),
    );
    $("#legend").replaceChildren(...legend);
    for (const swatch of $("#legend").children) swatch.style.borderColor = swatch.dataset.color;
  }

  // A line chart over the last HISTORY_POINTS samples; null values leave gaps.
  function drawLines(canvas, series, { log }) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    if (canvas.width !== width * ratio) {
      canvas.width = width * ratio;
      canvas.height = height * ratio;
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const scale = (v) => (log ? Math.log10(Math.max(v, 1)) : v);
    const values = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
    const top = Math.max(log ? 10 : 1, ...values);
    const [left, right, upper, lower] = [44, 8, 8, 18];
    const plotW = width - left - right;
    const plotH = height - upper - lower;
    const y = (v) => upper + plotH * (1 - scale(v) / scale(top));
    const x = (i) => left + (plotW * i) / (HISTORY_POINTS - 1);

    ctx.strokeStyle = "#3a3f4b";
    ctx.fillStyle = "#9aa3b2";
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    const ticks = log
      ? [1, 10, 100, 1000, 10000, 100000].filter((t) => t <= top)
      : [0, top / 2, top];
    for (const tick of ticks) {
      const ty = log && tick === 1 ? upper + plotH : y(tick);
      ctx.beginPath();
      ctx.moveTo(left, ty);
      ctx.lineTo(left + plotW, ty);
      ctx.stroke();
      ctx.fillText(fmt(tick), 4, ty + 4);
    }
    ctx.fillText(`last ${HISTORY_POINTS} s`, left, height - 4);

    ctx.lineWidth = 1.6;
    for (const s of series) {
      const offset = HISTORY_POINTS - s.values.length;
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) {
          pen = false;
          return;
        }
        const px = x(offset + i);
        const py = y(v);
        if (pen) ctx.lineTo(px, py);
        else ctx.moveTo(px, py);
        pen = true;
      });
      ctx.stroke();
    }
  }

  token = readToken();
  poll();
})();
