// shoal dashboard: one stream of every run's new points, drawn with uPlot.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22"];
const PHASES = ["data", "compute", "comm", "optimizer", "other"];
const PHASE_COLORS = ["#8dd3c7", "#80b1d3", "#fb8072", "#fdb462", "#bebada"];
const token = new URLSearchParams(location.search).get("token");
const runs = [];          // what the server sent, per run
const charts = {};        // uPlot instances by element id
let focus = 0;            // the run whose per-rank views are shown
let dirty = false;
let link = "connecting";  // the stream: "live", "lost" (retrying), "stopped", "refused"
let linkSince = null;     // when it was lost or stopped

const $ = (id) => document.getElementById(id);
const color = (i) => COLORS[i % COLORS.length];
const withToken = (url) => token ? `${url}${url.includes("?") ? "&" : "?"}token=${encodeURIComponent(token)}` : url;
const si = (v) => {
  const a = Math.abs(v);
  return a >= 1e9 ? `${+(v / 1e9).toFixed(2)}G` : a >= 1e6 ? `${+(v / 1e6).toFixed(2)}M` :
    a >= 1e4 ? `${+(v / 1e3).toFixed(1)}k` : `${+v.toFixed(3)}`;
};
const isRL = (run) => run.points.some((p) => p.episode_return !== undefined);

// ---- the stream --------------------------------------------------------------------------

// Once every run has ended nothing more can come: a stream lost then is not retried. A
// server that stops says so first ("closed"); a stream lost without that (the server was
// killed, the network went) is retried, as EventSource does, until it comes back.
function connect() {
  const source = new EventSource(withToken("api/events"));
  const lost = (state) => {
    if (link !== state) linkSince = new Date();
    link = state;
    if (state !== "lost") source.close();
    showStatus();
  };
  source.onopen = () => { link = "live"; showStatus(); };
  source.addEventListener("closed", () => lost("stopped"));
  source.onerror = () => {
    // CLOSED here: the server answered, but not with a stream (a new token?).
    if (source.readyState === EventSource.CLOSED) lost("refused");
    else lost(runs.length && runs.every(ended) ? "stopped" : "lost");
  };
  source.addEventListener("snapshot", (e) => {
    runs.length = 0;
    for (const run of JSON.parse(e.data).runs) runs.push(run);
    setupRuns();
    changed();
  });
  source.addEventListener("changes", (e) => {
    for (const change of JSON.parse(e.data)) apply(change);
    changed();
  });
}

const ended = (run) => run.events.length > 0 && run.events[run.events.length - 1].kind === "end";

// When the newest record of `run` was written (seconds), from the records' own times.
function newest(run) {
  let t = null;
  for (const key of ["points", "windows", "validation", "events"]) {
    const list = run[key];
    const last = list.length ? list[list.length - 1].time : null;
    if (typeof last === "number" && (t === null || last > t)) t = last;
  }
  return t;
}

function showStatus() {
  const run = runs[focus] || runs[0];
  const since = linkSince ? linkSince.toLocaleTimeString() : "";
  const note = {connecting: "", live: "", lost: ` · connection lost at ${since}, reconnecting…`,
    stopped: ` · server stopped at ${since}`,
    refused: " · the server refused the stream: open the address it printed (with its token)",
  }[link];
  if (!run) {
    $("status").textContent = link === "connecting" ? "connecting…" : note.slice(3);
    return;
  }
  const last = run.points.length ? run.points[run.points.length - 1].step : null;
  const t = newest(run);
  $("status").textContent = (last === null ? `${run.name}: waiting for the first step` :
    `${run.name}: step ${last}`) + (ended(run) ? " · ended" : "") +
    (t === null ? "" : ` · updated ${new Date(1000 * t).toLocaleTimeString()}`) + note;
  document.body.dataset.lastStep = last === null ? "" : String(last);
  document.body.dataset.updated = t === null ? "" : String(t);
  document.body.dataset.link = link;
  document.body.dataset.ended = String(ended(run));
}

function apply(change) {
  const run = runs[change.run];
  if (change.reset) {
    Object.assign(run, {points: [], windows: [], validation: [], events: []});
  }
  const replace = change.replace || [];
  for (const key of ["points", "windows", "validation", "events"]) {
    if (!change[key]) continue;
    run[key] = replace.includes(key) ? change[key] : run[key].concat(change[key]);
  }
  if (change.alerts) run.alerts = change.alerts;
}

function changed() {
  if (dirty) return;
  dirty = true;
  requestAnimationFrame(() => { dirty = false; draw(); });
}

// ---- layout ------------------------------------------------------------------------------

function setupRuns() {
  $("runs").innerHTML = "";
  const select = $("focus");
  select.innerHTML = "";
  runs.forEach((run, i) => {
    const tag = document.createElement("span");
    tag.innerHTML = `<i style="background:${color(i)}"></i>`;
    tag.append(run.name);
    tag.title = run.dir;
    $("runs").append(tag);
    select.append(new Option(run.name, i));
  });
  select.value = String(focus);
  select.onchange = () => { focus = Number(select.value); rebuildRankCharts(); draw(); };
}

function width(id) {
  return Math.max(300, $(id).parentElement.clientWidth - 16);
}

// Vertical marks where a run started again (a restart or a resume).
function marks(runIndexes) {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        for (const i of runIndexes) {
          const starts = runs[i].events.filter((e) => e.kind === "start" || e.kind === "resume");
          starts.slice(1).forEach((e) => {
            const x = u.valToPos(e.step, "x", true);
            if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
            ctx.save();
            ctx.strokeStyle = color(i);
            ctx.setLineDash([4, 4]);
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
            ctx.fillStyle = color(i);
            ctx.font = `${10 * devicePixelRatio}px sans-serif`;
            const label = e.kind === "resume" ? "resumed" : `restart ${e.restart || ""}`;
            ctx.fillText(label, x + 3, u.bbox.top + 12 * devicePixelRatio);
            ctx.restore();
          });
        }
      }],
    },
  };
}

function chart(id, series, data, opts = {}) {
  let u = charts[id];
  const keys = series.map((s) => s.label).join("|");
  if (u && u._keys !== keys) { u.destroy(); u = null; }
  if (!u) {
    u = new uPlot({
      width: width(id), height: opts.height || 200,
      scales: {x: {time: false}, ...(opts.scales || {})},
      axes: [{label: opts.xlabel || "step"},
        {size: 56, values: (u, ticks) => ticks.map(si), ...(opts.yaxis || {})}],
      series: [{label: "step"}, ...series],
      plugins: [marks(opts.marks || [])],
      legend: {live: true},
      bands: opts.bands || [],
      cursor: {drag: {x: true, y: false}},
    }, data, $(id));
    u._keys = keys;
    charts[id] = u;
  } else {
    u.setData(data, true);
  }
  return u;
}

function rebuildRankCharts() {
  for (const id of ["split", "cpu", "rss", "gpu", "gpumem"]) {
    if (charts[id]) { charts[id].destroy(); delete charts[id]; }
  }
}

// One table per run (x, ys...), joined on the step so runs of other lengths overlay.
function joined(tables) {
  const present = tables.filter((t) => t[0].length);
  if (!present.length) return [[]];
  return present.length === 1 ? present[0] : uPlot.join(present);
}

function column(records, field) {
  return records.map((r) => (r[field] === undefined ? null : r[field]));
}

// ---- drawing -----------------------------------------------------------------------------

function draw() {
  if (!runs.length) return;
  drawCurves();
  drawFocus();
  drawAlerts();
  showStatus();
  document.body.dataset.points = String(runs.reduce((n, r) => n + r.points.length, 0));
}

// A line of `field` per run, and its `dotField` validations as dots.
function lineWithDots(id, field, dotField, label, dotLabel, shown) {
  const series = [], tables = [];
  runs.forEach((run, i) => {
    if (!shown[i]) return;
    series.push({label: `${run.name} ${label}`, stroke: color(i), spanGaps: true});
    tables.push([run.points.map((p) => p.step), column(run.points, field)]);
    const dots = run.validation.filter((v) => v[dotField] !== undefined);
    series.push({label: `${run.name} ${dotLabel}`, stroke: color(i), width: 0,
      points: {show: true, size: 7, fill: color(i)}});
    tables.push([dots.map((v) => v.step), column(dots, dotField)]);
  });
  plotJoined(id, series, tables, {marks: runs.map((_, i) => i)});
}

function drawCurves() {
  const all = runs.map((_, i) => i);
  lineWithDots("loss", "loss", "val_loss", "loss", "val_loss", runs.map(() => true));
  const rl = runs.map(isRL);
  $("return-panel").hidden = !rl.some(Boolean);
  if (rl.some(Boolean)) lineWithDots("return", "episode_return", "eval_return", "return", "eval", rl);
  $("throughput-title").textContent = rl.every(Boolean) ? "environment steps/s" :
    rl.some(Boolean) ? "samples/s (environment steps/s for RL runs)" : "samples/s";
  perRun("throughput", "samples_per_s", all);
  perRun("bytes", "comm_bytes", all);
  const tokens = runs.some((r) => r.points.some((p) => p.tokens_per_s));
  $("tokens-panel").hidden = !tokens;
  if (tokens) {
    perRun("tokens", "tokens_per_s", all);
    const mfu = runs.map((r) => r.points.length && r.points[r.points.length - 1].mfu)
      .map((m, i) => (m ? `${runs[i].name} MFU ${(100 * m).toFixed(1)}%` : "")).filter(Boolean);
    $("mfu").textContent = mfu.join(" · ");
  }
}

function perRun(id, field, all) {
  const series = runs.map((run, i) => ({label: run.name, stroke: color(i), spanGaps: true}));
  const tables = runs.map((run) => [run.points.map((p) => p.step), column(run.points, field)]);
  plotJoined(id, series, tables, {marks: all});
}

function plotJoined(id, series, tables, opts) {
  const keep = tables.map((t) => t[0].length > 0);
  const shown = series.filter((_, i) => keep[i]);
  if (!shown.length) return;
  chart(id, shown, joined(tables.filter((_, i) => keep[i])), opts);
}

function drawFocus() {
  const run = runs[focus];
  if (!run) return;
  $("split-run").textContent = runs.length > 1 ? `(${run.name})` : "";
  // The step split, stacked: each band is one phase's mean time over the ranks.
  const steps = run.points.map((p) => p.step);
  const stacked = [];
  let below = steps.map(() => 0);
  for (const phase of PHASES) {
    const top = run.points.map((p, k) => below[k] + 1e3 * ((p.phases_s || {})[phase] || 0));
    stacked.push(top);
    below = top;
  }
  const series = PHASES.map((phase, k) => ({label: phase, stroke: PHASE_COLORS[k],
    fill: PHASE_COLORS[k] + "aa", value: (u, v, si, idx) => (idx === null ? "--" :
      (v - (si > 1 ? u.data[si - 1][idx] : 0)).toFixed(2))}));
  const bands = PHASES.slice(1).map((_, k) => ({series: [k + 2, k + 1]}));
  if (steps.length) chart("split", series, [steps, ...stacked], {bands, marks: [focus]});
  heatmap("heat-step", run, "rank_step_s");
  heatmap("heat-comm", run, "rank_comm_s");
  drawResources(run);
  const last = [...run.windows].reverse().find((w) => w.straggler);
  const now = run.windows.length ? run.windows[run.windows.length - 1] : null;
  const box = $("straggler");
  if (last) {
    const s = last.straggler, current = now === last;
    box.hidden = false;
    box.textContent = `${run.name}: ${current ? "straggler" : "last straggler"} at steps ` +
      `${last.steps[0]}-${last.steps[1]}: rank ${s.rank}, in its ${s.phase} phase ` +
      `(+${(1e3 * s.phase_excess_s).toFixed(1)} ms/step over the median rank; busy ` +
      `${(1e3 * s.busy_s).toFixed(1)} against ${(1e3 * s.median_busy_s).toFixed(1)} ms)`;
  } else {
    box.hidden = true;
  }
}

function drawResources(run) {
  const windows = run.windows;
  const steps = windows.map((w) => w.steps[1]);
  const world = windows.length ? windows[windows.length - 1].ranks.length : 0;
  const field = (name, scale) => Array.from({length: world}, (_, r) =>
    windows.map((w) => {
      const v = w.ranks[r] ? w.ranks[r][name] : null;
      return v === null || v === undefined ? null : v * scale;
    }));
  const series = Array.from({length: world}, (_, r) => ({label: `rank ${r}`, stroke: color(r),
    spanGaps: true}));
  if (!world) return;
  chart("cpu", series, [steps, ...field("cpu_percent", 1)], {height: 160, marks: [focus]});
  chart("rss", series, [steps, ...field("rss_bytes", 1 / 2 ** 20)], {height: 160, marks: [focus]});
  const gpu = windows.some((w) => w.ranks.some((r) => r.gpu_util_percent !== null &&
    r.gpu_util_percent !== undefined));
  document.querySelectorAll(".gpu").forEach((el) => { el.hidden = !gpu; });
  if (gpu) {
    chart("gpu", series, [steps, ...field("gpu_util_percent", 1)], {height: 160, marks: [focus]});
    chart("gpumem", series, [steps, ...field("gpu_memory_bytes", 1 / 2 ** 20)],
      {height: 160, marks: [focus]});
  }
}

// Rank x step: a column per point, a row per rank; darker is slower. Ranks are labelled on
// the left, steps below, and the colour bar on the right gives the scale in ms.
const HEAT = {left: 52, right: 76, bottom: 20, font: "11px sans-serif"};
const shade = (t) => [252 - 197 * t, 246 - 221 * t, 216 - 81 * t];
const ms = (v) => `${(1e3 * v).toFixed(1)} ms`;

function heatmap(id, run, field) {
  const canvas = $(id);
  const points = run.points.filter((p) => Array.isArray(p[field]));
  const w = Math.max(300, canvas.parentElement.clientWidth - 16);
  const world = points.length ? points[points.length - 1][field].length : 0;
  const plotH = Math.max(40, Math.min(240, world * 14));
  const h = plotH + HEAT.bottom;
  canvas.width = w;
  canvas.height = h;
  canvas.style.height = `${h}px`;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  Object.assign(canvas.dataset, {ranks: "", steps: "", scale: ""});
  if (!points.length || !world) return;
  const plotW = w - HEAT.left - HEAT.right;
  const values = points.flatMap((p) => p[field]).filter((v) => typeof v === "number")
    .sort((a, b) => a - b);
  const lo = values[0] || 0;
  const hi = values[Math.floor(0.99 * (values.length - 1))] || 1;
  const pointAt = (x) => points[Math.min(points.length - 1, Math.floor((x / plotW) * points.length))];
  const row = plotH / world;
  const image = ctx.createImageData(plotW, plotH);
  for (let x = 0; x < plotW; x++) {
    const p = pointAt(x);
    for (let r = 0; r < world; r++) {
      const v = p[field][r];
      const t = typeof v !== "number" ? 0 : Math.min(1, Math.max(0, (v - lo) / (hi - lo || 1)));
      const [cr, cg, cb] = shade(t);
      for (let y = Math.floor(r * row); y < Math.floor((r + 1) * row); y++) {
        const o = 4 * (y * plotW + x);
        image.data[o] = cr; image.data[o + 1] = cg; image.data[o + 2] = cb; image.data[o + 3] = 255;
      }
    }
  }
  ctx.putImageData(image, HEAT.left, 0);
  ctx.font = HEAT.font;
  ctx.fillStyle = "#222";
  ctx.strokeStyle = "#222";
  // Ranks: as many labels as fit, 12 px apart at least.
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const ranks = [];
  for (let r = 0; r < world; r += Math.ceil(12 / row)) {
    ctx.fillText(`rank ${r}`, HEAT.left - 4, (r + 0.5) * row);
    ranks.push(r);
  }
  // Steps: a tick about every 100 px, at the step its column shows.
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const steps = [];
  const ticks = Math.max(2, Math.floor(plotW / 100));
  for (let k = 0; k < ticks; k++) {
    const x = Math.round((k / (ticks - 1)) * (plotW - 1));
    const step = pointAt(x).step;
    ctx.fillRect(HEAT.left + x, plotH, 1, 4);
    ctx.textAlign = k === 0 ? "left" : k === ticks - 1 ? "right" : "center";
    ctx.fillText(String(step), HEAT.left + x, plotH + 5);
    steps.push(step);
  }
  // The colour bar: light (fastest) at the bottom, dark (99th percentile and over) on top.
  const barX = w - HEAT.right + 8;
  for (let y = 0; y < plotH; y++) {
    const [cr, cg, cb] = shade(1 - y / Math.max(1, plotH - 1));
    ctx.fillStyle = `rgb(${cr},${cg},${cb})`;
    ctx.fillRect(barX, y, 12, 1);
  }
  ctx.fillStyle = "#222";
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillText(ms(hi), barX + 15, 0);
  ctx.textBaseline = "bottom";
  ctx.fillText(ms(lo), barX + 15, plotH);
  Object.assign(canvas.dataset, {ranks: ranks.join(","), steps: steps.join(","),
    scale: `${lo},${hi}`});
  $(`${id}-scale`).textContent = `darker is slower; ${world} ranks, steps ` +
    `${points[0].step}-${points[points.length - 1].step}`;
  canvas.onmousemove = (e) => {
    const box = canvas.getBoundingClientRect();
    const x = (e.clientX - box.left) * (w / box.width) - HEAT.left;
    const y = (e.clientY - box.top) * (h / box.height);
    const tip = $("tip");
    if (x < 0 || x >= plotW || y >= plotH) { tip.hidden = true; return; }
    const p = pointAt(x);
    const r = Math.min(world - 1, Math.floor(y / row));
    const v = p[field][r];
    tip.hidden = false;
    tip.style.left = `${e.clientX + 12}px`;
    tip.style.top = `${e.clientY + 12}px`;
    tip.textContent = `rank ${r}, step ${p.step}: ${typeof v !== "number" ? "–" : (1e3 * v).toFixed(2)} ms`;
  };
  canvas.onmouseleave = () => { $("tip").hidden = true; };
}

function drawAlerts() {
  const box = $("alerts");
  const lines = runs.flatMap((run) => Object.values(run.alerts || {}));
  box.hidden = !lines.length;
  box.replaceChildren(...lines.map((text) => {
    const div = document.createElement("div");
    div.textContent = text;
    return div;
  }));
}

new ResizeObserver(() => changed()).observe(document.querySelector("main"));
window.addEventListener("resize", () => {
  for (const [id, u] of Object.entries(charts)) u.setSize({width: width(id), height: u.height});
  changed();
});

connect();
