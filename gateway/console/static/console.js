// Portico admin console. Plain JavaScript, no build step, no third-party code.
// It talks only to the admin REST API (/admin/v1) and its own session route (/admin/ui/session),
// same-origin, with the HttpOnly session cookie; every change carries the session's CSRF token.
// The page's Content-Security-Policy allows scripts and styles from this origin only, so
// nothing here uses inline handlers, inline styles or eval; every node is built with the DOM.
"use strict";

(function () {
  const state = { csrf: null, who: null, plans: [], tenants: [] };
  const main = document.getElementById("main");

  // ---------------------------------------------------------------- DOM helpers

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "text") el.textContent = v;
      else el.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  let fieldSeq = 0;
  // A labelled input: every field has a <label for>.
  function field(label, attrs) {
    const id = attrs.id || "f" + (++fieldSeq);
    const input = attrs.options
      ? h("select", { id, name: attrs.name, required: attrs.required },
          attrs.options.map(([value, text]) =>
            h("option", { value, selected: value === attrs.value }, text)))
      : h("input", { id, type: "text", ...attrs, value: attrs.value ?? null });
    return h("div", { class: "field" }, h("label", { for: id }, label), input);
  }

  function table(caption, headers, rows) {
    return h("table", {},
      h("caption", {}, caption),
      h("thead", {}, h("tr", {}, headers.map((x) =>
        h("th", { scope: "col", class: x.endsWith("#") ? "num" : null }, x.replace(/#$/, ""))))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: headers.length }, "None."))));
  }

  function cell(value, cls) { return h("td", { class: cls || null }, value ?? "–"); }
  function num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function when(unix) { return unix ? new Date(unix * 1000).toISOString().replace("T", " ").slice(0, 19) : "–"; }

  function say(message) {
    document.getElementById("alert").textContent = "";
    document.getElementById("status").textContent = message;
  }
  function fail(message) {
    document.getElementById("status").textContent = "";
    document.getElementById("alert").textContent = message;
  }

  function page(title, ...children) {
    main.replaceChildren(h("h1", {}, title), ...children.filter((c) => c !== null && c !== undefined));
    main.focus();
  }

  // ---------------------------------------------------------------- the API

  class APIError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET" && state.csrf) headers["X-CSRF-Token"] = state.csrf;
    const resp = await fetch(path, {
      method, headers, credentials: "same-origin", cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (resp.status === 204) return null;
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (!resp.ok) {
      const message = (data && data.error && data.error.message) || resp.statusText;
      if (resp.status === 401 && path !== "/admin/ui/session") { signedOut(); }
      throw new APIError(resp.status, message);
    }
    return data;
  }

  // Runs an action; shows its error (OpenAI's error message) in the alert region.
  async function attempt(fn) {
    try { return await fn(); } catch (e) { fail(e.message); return undefined; }
  }

  const enc = encodeURIComponent;

  async function loadTenants() {
    state.tenants = (await api("GET", "/admin/v1/tenants")).data;
    return state.tenants;
  }

  function tenantSelect(label, selected, onchange) {
    const f = field(label, {
      name: "tenant", value: selected,
      options: [["", "— choose a tenant —"], ...state.tenants.map((t) => [t.id, `${t.id} (${t.name})`])],
    });
    f.querySelector("select").addEventListener("change", onchange);
    return f;
  }

  // ---------------------------------------------------------------- sign-in

  function signedOut() {
    state.csrf = null; state.who = null;
    document.getElementById("nav").hidden = true;
    document.getElementById("sign-out").hidden = true;
    document.getElementById("who").textContent = "";
    showSignIn();
  }

  function signedIn(session) {
    state.csrf = session.csrf_token;
    state.who = session.actor;
    document.getElementById("nav").hidden = false;
    document.getElementById("sign-out").hidden = false;
    document.getElementById("who").textContent = "Signed in as " + session.actor;
  }

  function showSignIn() {
    const form = h("form", { class: "panel signin", "aria-labelledby": "signin-title" },
      field("Admin key or admin JWT", { id: "credential", name: "credential", type: "password",
        autocomplete: "off", required: true }),
      h("p", {}, h("button", { type: "submit" }, "Sign in")));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const credential = form.querySelector("#credential").value.trim();
      const session = await attempt(() => api("POST", "/admin/ui/session", { credential }));
      form.querySelector("#credential").value = "";
      if (session) {
        signedIn(session);
        say("Signed in.");
        if (location.hash && location.hash !== "#signin") route(); else location.hash = "#tenants";
      }
    });
    main.replaceChildren(h("h1", { id: "signin-title" }, "Sign in"),
      h("p", { class: "muted" }, "The credential is checked once; the browser then holds only an HttpOnly session cookie."),
      form);
    form.querySelector("#credential").focus();
  }

  // ---------------------------------------------------------------- tenants

  const LIMITS = [
    ["requests_per_minute", "Requests per minute"],
    ["tokens_per_minute", "Tokens per minute"],
    ["max_concurrency", "Max concurrency"],
    ["monthly_token_budget", "Monthly token budget"],
    ["max_tokens_default", "Default max_tokens"],
  ];

  async function showTenants() {
    const [plans] = await Promise.all([api("GET", "/admin/v1/plans"), loadTenants()]);
    state.plans = plans.data.map((p) => p.name);
    const planOptions = state.plans.map((p) => [p, p]);
    const create = h("form", { class: "panel", "aria-label": "Create a tenant" },
      h("h2", {}, "Create a tenant"),
      h("div", { class: "fields" },
        field("Tenant id", { id: "new-tenant-id", name: "id", pattern: "[a-z0-9][a-z0-9_-]{0,62}", required: true }),
        field("Name", { id: "new-tenant-name", name: "name", required: true }),
        field("Plan", { id: "new-tenant-plan", name: "plan", options: planOptions, value: plans.default }),
        h("button", { type: "submit" }, "Create tenant")));
    create.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = { id: create.querySelector("#new-tenant-id").value.trim(),
        name: create.querySelector("#new-tenant-name").value.trim(),
        plan: create.querySelector("#new-tenant-plan").value };
      const made = await attempt(() => api("POST", "/admin/v1/tenants", body));
      if (made) { say(`Tenant ${made.id} created.`); await showTenants(); }
    });
    const rows = state.tenants.map((t) => h("tr", {},
      cell(t.id), cell(t.name), cell(t.plan),
      cell(h("span", { class: "tag " + (t.disabled ? "bad" : "ok") }, t.disabled ? "disabled" : "active")),
      cell(num(t.effective && t.effective.limits.requests_per_minute), "num"),
      cell(num(t.effective && t.effective.limits.tokens_per_minute), "num"),
      h("td", {}, h("div", { class: "row-actions" },
        h("button", { type: "button", class: "secondary", "aria-label": `Edit tenant ${t.id}`,
          onclick: () => editTenant(t) }, "Edit"),
        h("button", { type: "button", class: t.disabled ? "secondary" : "danger",
          "aria-label": `${t.disabled ? "Enable" : "Disable"} tenant ${t.id}`,
          onclick: async () => {
            const done = await attempt(() => api("PATCH", `/admin/v1/tenants/${enc(t.id)}`, { disabled: !t.disabled }));
            if (done) { say(`Tenant ${t.id} ${t.disabled ? "enabled" : "disabled"}.`); await showTenants(); }
          } }, t.disabled ? "Enable" : "Disable"),
        h("a", { href: `#keys/${enc(t.id)}` }, "Keys"),
        h("a", { href: `#usage/${enc(t.id)}` }, "Usage")))));
    page("Tenants", create,
      table("Tenants, their plan and effective limits", ["Id", "Name", "Plan", "Status", "Requests/min#", "Tokens/min#", "Actions"], rows),
      h("div", { id: "edit-area" }));
  }

  function editTenant(t) {
    const area = document.getElementById("edit-area");
    const form = h("form", { class: "panel", "aria-label": `Edit tenant ${t.id}` },
      h("h2", {}, `Edit ${t.id}`),
      h("div", { class: "fields" },
        field("Name", { id: "edit-name", value: t.name, required: true }),
        field("Plan", { id: "edit-plan", options: state.plans.map((p) => [p, p]), value: t.plan }),
        ...LIMITS.map(([k, label]) => field(label + " override", {
          id: "edit-" + k, type: "number", min: "0", step: "1",
          value: t.overrides[k] === null ? "" : String(t.overrides[k]), placeholder: "plan's" }))),
      h("p", {}, h("button", { type: "submit" }, "Save changes"), " ",
        h("button", { type: "button", class: "secondary", onclick: () => area.replaceChildren() }, "Cancel")));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const overrides = {};
      for (const [k] of LIMITS) {
        const v = form.querySelector("#edit-" + k).value.trim();
        overrides[k] = v === "" ? null : Number(v);
      }
      const body = { name: form.querySelector("#edit-name").value.trim(),
        plan: form.querySelector("#edit-plan").value, overrides };
      const done = await attempt(() => api("PATCH", `/admin/v1/tenants/${enc(t.id)}`, body));
      if (done) { say(`Tenant ${t.id} saved.`); await showTenants(); }
    });
    area.replaceChildren(form);
    form.querySelector("#edit-name").focus();
  }

  // ---------------------------------------------------------------- keys

  function keyStatus(k) {
    return h("span", { class: "tag " + (k.status === "active" ? "ok" : "bad") }, k.status);
  }

  async function showKeys(tenantId) {
    await loadTenants();
    const chooser = tenantSelect("Tenant", tenantId || "", (ev) => { location.hash = "#keys/" + enc(ev.target.value); });
    if (!tenantId) { page("Keys", h("form", { class: "panel" }, chooser)); return; }
    const keys = (await api("GET", `/admin/v1/tenants/${enc(tenantId)}/keys`)).data;
    const secretBox = h("div", { id: "secret-area" });
    const create = h("form", { class: "panel", "aria-label": "Create a key" },
      h("h2", {}, "Create a key"),
      h("div", { class: "fields" },
        field("Key name", { id: "new-key-name", name: "name" }),
        field("Expires in (seconds, empty: never)", { id: "new-key-expiry", type: "number", min: "1", step: "1" }),
        h("button", { type: "submit" }, "Create key")));
    create.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = {};
      const name = create.querySelector("#new-key-name").value.trim();
      const expiry = create.querySelector("#new-key-expiry").value.trim();
      if (name) body.name = name;
      if (expiry) body.expires_in_seconds = Number(expiry);
      const made = await attempt(() => api("POST", `/admin/v1/tenants/${enc(tenantId)}/keys`, body));
      if (made) { await showKeys(tenantId); showSecret(made, "created"); }
    });
    const rows = keys.map((k) => h("tr", {},
      cell(k.id), cell(k.name), cell(k.display), cell(keyStatus(k)), cell(when(k.created)),
      cell(when(k.expires_at || k.revoked_at)), cell(k.replaced_by),
      h("td", {}, k.status !== "active" ? "" : h("div", { class: "row-actions" },
        h("button", { type: "button", class: "danger", "aria-label": `Revoke key ${k.id}`,
          onclick: async () => {
            const done = await attempt(() => api("POST", `/admin/v1/tenants/${enc(tenantId)}/keys/${enc(k.id)}/revoke`));
            if (done) { await showKeys(tenantId); say(`Key ${k.id} revoked.`); }
          } }, "Revoke"),
        h("button", { type: "button", class: "secondary", "aria-label": `Rotate key ${k.id}`,
          onclick: () => rotateForm(tenantId, k) }, "Rotate")))));
    page(`Keys of ${tenantId}`, h("form", { class: "panel" }, chooser), secretBox, create,
      table("API keys (secrets are never shown again after creation)",
        ["Id", "Name", "Key", "Status", "Created", "Expires / revoked", "Replaced by", "Actions"], rows),
      h("div", { id: "rotate-area" }));
  }

  function showSecret(made, verb) {
    const area = document.getElementById("secret-area");
    area.replaceChildren(h("section", { class: "panel", "aria-labelledby": "secret-title" },
      h("h2", { id: "secret-title" }, `Key ${made.id} ${verb}: copy the secret now`),
      h("p", {}, "This is the only time the secret is shown."),
      h("p", { class: "secret", id: "new-secret", tabindex: "0" }, made.key)));
    say(`Key ${made.id} ${verb}.`);
    document.getElementById("new-secret").focus();
  }

  function rotateForm(tenantId, k) {
    const area = document.getElementById("rotate-area");
    const form = h("form", { class: "panel", "aria-label": `Rotate key ${k.id}` },
      h("h2", {}, `Rotate ${k.id}`),
      h("div", { class: "fields" },
        field("Grace period for the old secret (seconds)", { id: "grace", type: "number", min: "0", step: "1", value: "3600" }),
        h("button", { type: "submit" }, "Rotate key")));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const grace = Number(form.querySelector("#grace").value || 0);
      const made = await attempt(() => api("POST",
        `/admin/v1/tenants/${enc(tenantId)}/keys/${enc(k.id)}/rotate`, { grace_seconds: grace }));
      if (made) { await showKeys(tenantId); showSecret(made, "rotated in"); }
    });
    area.replaceChildren(form);
    form.querySelector("#grace").focus();
  }

  // ---------------------------------------------------------------- usage (inline SVG)

  const SVG = "http://www.w3.org/2000/svg";
  function s(tag, attrs, ...children) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
    for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return el;
  }

  // A stacked bar chart: one bar per day, one colour per model (at most six, then "other").
  function usageChart(days, models, title) {
    const W = 900, H = 260, L = 64, B = 40, T = 16;
    const totals = days.map((d) => d.total_tokens);
    const top = Math.max(1, ...totals);
    const bw = Math.max(4, Math.min(40, (W - L - 10) / Math.max(1, days.length) - 4));
    const svg = s("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-labelledby": "chart-title" },
      s("title", { id: "chart-title" }, title),
      s("line", { class: "axis", x1: L, y1: H - B, x2: W - 4, y2: H - B }),
      s("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
    for (const f of [0, 0.5, 1]) {
      const y = H - B - f * (H - B - T);
      svg.append(s("text", { x: L - 6, y: y + 4, "text-anchor": "end" }, num(Math.round(top * f))));
    }
    days.forEach((d, i) => {
      const x = L + 6 + i * (bw + 4);
      let y = H - B;
      models.forEach((m, j) => {
        const v = (d.models[m] || {}).total_tokens || 0;
        if (!v) return;
        const hgt = (v / top) * (H - B - T);
        y -= hgt;
        svg.append(s("rect", { class: "s" + (j % 6), x, y, width: bw, height: Math.max(hgt, 1) },
          s("title", {}, `${d.date} ${m}: ${num(v)} tokens`)));
      });
      if (days.length <= 16 || i % Math.ceil(days.length / 12) === 0) {
        svg.append(s("text", { x: x + bw / 2, y: H - B + 14, "text-anchor": "middle" }, d.date.slice(5)));
      }
    });
    svg.append(s("text", { x: L, y: H - 6 }, "UTC day (MM-DD); bars: total tokens per model"));
    return svg;
  }

  // Integer micro-dollars as exact dollars with six decimals (1000001 -> "$1.000001").
  function usd(micro) {
    const m = Math.max(0, Math.round(micro || 0));
    return `$${Math.floor(m / 1e6)}.${String(m % 1e6).padStart(6, "0")}`;
  }

  async function showUsage(tenantId) {
    await loadTenants();
    const chooser = tenantSelect("Tenant", tenantId || "", (ev) => { location.hash = "#usage/" + enc(ev.target.value); });
    if (!tenantId) { page("Usage", h("form", { class: "panel" }, chooser)); return; }
    const u = await api("GET", `/admin/v1/tenants/${enc(tenantId)}/usage`);
    const models = Object.keys(u.models).sort();
    const legend = h("div", { class: "legend", "aria-hidden": "true" },
      models.map((m, j) => h("span", {}, h("span", { class: "sw s" + (j % 6) }), m)));
    const byModel = models.map((m) => h("tr", {}, cell(m), cell(num(u.models[m].requests), "num"),
      cell(num(u.models[m].prompt_tokens), "num"), cell(num(u.models[m].cached_tokens), "num"),
      cell(num(u.models[m].completion_tokens), "num"), cell(num(u.models[m].total_tokens), "num"),
      cell(usd(u.models[m].spend_micro_usd), "num")));
    const keys = Object.keys(u.keys || {}).sort();
    const byKey = keys.map((k) => h("tr", {}, cell(k), cell(num(u.keys[k].requests), "num"),
      cell(num(u.keys[k].total_tokens), "num"), cell(usd(u.keys[k].spend_micro_usd), "num")));
    const byDay = [];
    for (const d of u.days) for (const m of Object.keys(d.models).sort()) {
      const c = d.models[m];
      byDay.push(h("tr", {}, cell(d.date), cell(m), cell(num(c.requests), "num"),
        cell(num(c.prompt_tokens), "num"), cell(num(c.completion_tokens), "num"),
        cell(usd(c.spend_micro_usd), "num")));
    }
    page(`Usage of ${tenantId}`, h("form", { class: "panel" }, chooser),
      h("p", {}, `${u.start} to ${u.end}: ${num(u.totals.requests)} requests, ${num(u.totals.total_tokens)} tokens, ${usd(u.totals.spend_micro_usd)} spent.`),
      usageChart(u.days, models, `Tokens per day for ${tenantId}`), legend,
      table("Per model", ["Model", "Requests#", "Prompt tokens#", "Cached tokens#", "Completion tokens#", "Total tokens#", "Spend (USD)#"], byModel),
      table("Per API key (requests made with a key)", ["Key", "Requests#", "Total tokens#", "Spend (USD)#"], byKey),
      table("Per model and day", ["Day", "Model", "Requests#", "Prompt tokens#", "Completion tokens#", "Spend (USD)#"], byDay));
  }

  // ---------------------------------------------------------------- engines

  function meter(fraction, label) {
    const f = Math.max(0, Math.min(1, fraction || 0));
    return s("svg", { viewBox: "0 0 100 12", width: "100", height: "12", role: "img", "aria-label": label },
      s("rect", { class: "meter-bg", x: 0, y: 0, width: 100, height: 12 }),
      s("rect", { class: "meter" + (f > 0.9 ? " high" : ""), x: 0, y: 0, width: 100 * f, height: 12 }));
  }

  async function showEngines() {
    const engines = (await api("GET", "/admin/v1/engines")).data;
    const rows = engines.map((e) => {
      const m = e.metrics || {};
      const kv = m.kv_cache_usage;
      return h("tr", {}, cell(e.name), cell(e.model),
        cell(h("span", { class: "tag " + (e.state === "ready" ? "ok" : "bad") }, e.state)),
        cell(num(e.restarts), "num"), cell(num(m.running), "num"), cell(num(m.waiting), "num"),
        h("td", {}, kv === undefined ? "–" : [meter(kv, `KV cache ${Math.round(kv * 100)}% used`), ` ${(kv * 100).toFixed(1)}%`]),
        cell(num(e.outstanding), "num"));
    });
    page("Engines",
      h("p", {}, h("button", { type: "button", class: "secondary", onclick: () => showEngines() }, "Refresh")),
      table("Engine replicas (scraped from each engine's /metrics now)",
        ["Replica", "Model", "State", "Restarts#", "Running#", "Waiting#", "KV cache", "Outstanding here#"], rows),
      h("h2", {}, "Tenants on the engines"),
      table("Per tenant and replica: running slots held now and the slots the fair policy owes it while tenants contend, requests waiting, KV blocks held now and tokens scheduled since the engine started; shares are of that replica",
        ["Replica", "Tenant", "Running slots#", "Slot share#", "Waiting#", "KV blocks#", "KV share", "Tokens#", "Token share"],
        engines.flatMap(tenantRows)));
  }

  // One row per tenant of a replica, its shares of the replica's KV blocks and tokens as meters.
  function tenantRows(e) {
    const tenants = e.tenants || [];
    const blocks = tenants.reduce((sum, t) => sum + t.kv_blocks, 0);
    const tokens = tenants.reduce((sum, t) => sum + t.prompt_tokens + t.generation_tokens, 0);
    const share = (part, whole, what) => {
      const f = whole ? part / whole : 0;
      return h("td", {}, meter(f, `${what} ${Math.round(f * 100)}%`), ` ${(f * 100).toFixed(1)}%`);
    };
    return tenants.map((t) => {
      const served = t.prompt_tokens + t.generation_tokens;
      return h("tr", {}, cell(e.name), cell(t.tenant), cell(num(t.running), "num"),
        cell(t.slot_share ? num(t.slot_share) : "–", "num"), cell(num(t.waiting), "num"), cell(num(t.kv_blocks), "num"),
        share(t.kv_blocks, blocks, `${t.tenant}'s share of KV blocks held on ${e.name}:`),
        cell(num(served), "num"),
        share(served, tokens, `${t.tenant}'s share of tokens scheduled on ${e.name}:`));
    });
  }

  // ---------------------------------------------------------------- adapters

  async function showAdapters() {
    const adapters = (await api("GET", "/admin/v1/adapters")).data;
    const create = h("form", { class: "panel", "aria-label": "Register a LoRA adapter" },
      h("h2", {}, "Register a LoRA adapter"),
      h("div", { class: "fields" },
        field("Adapter name", { id: "ad-name", required: true }),
        field("Base model", { id: "ad-base", required: true }),
        field("Folder on the server", { id: "ad-path", required: true }),
        field("Owner tenant (empty: shared)", { id: "ad-tenant" }),
        h("button", { type: "submit" }, "Register adapter")));
    create.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = { name: create.querySelector("#ad-name").value.trim(),
        base_model: create.querySelector("#ad-base").value.trim(),
        path: create.querySelector("#ad-path").value.trim(),
        tenant_id: create.querySelector("#ad-tenant").value.trim() || null };
      const made = await attempt(() => api("POST", "/admin/v1/adapters", body));
      if (made) { await showAdapters(); say(`Adapter ${made.name} registered.`); }
    });
    const rows = adapters.map((a) => h("tr", {}, cell(a.name), cell(a.base_model),
      cell(a.tenant_id || "shared"), cell(a.loaded_on.join(", ") || "none"),
      h("td", {}, h("button", { type: "button", class: "danger", "aria-label": `Remove adapter ${a.name}`,
        onclick: async () => {
          const done = await attempt(() => api("DELETE", `/admin/v1/adapters/${enc(a.name)}`));
          if (done) { await showAdapters(); say(`Adapter ${a.name} removed.`); }
        } }, "Remove"))));
    page("LoRA adapters", create,
      table("Registered adapters", ["Name", "Base model", "Owner", "Loaded on", "Actions"], rows));
  }

  // ---------------------------------------------------------------- audit log

  async function showAudit(filters, before) {
    const q = new URLSearchParams({ limit: "50" });
    for (const [k, v] of Object.entries(filters)) if (v) q.set(k, v);
    if (before) q.set("before", before);
    const log = await api("GET", "/admin/v1/audit?" + q.toString());
    const form = h("form", { class: "panel", "aria-label": "Filter the audit log" },
      h("div", { class: "fields" },
        field("Action (e.g. key. or tenant.update)", { id: "flt-action", value: filters.action || "" }),
        field("Tenant", { id: "flt-tenant", value: filters.tenant_id || "" }),
        field("Actor", { id: "flt-actor", value: filters.actor || "" }),
        h("button", { type: "submit" }, "Filter")));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      showAudit({ action: form.querySelector("#flt-action").value.trim(),
        tenant_id: form.querySelector("#flt-tenant").value.trim(),
        actor: form.querySelector("#flt-actor").value.trim() });
    });
    const rows = log.data.map((e) => h("tr", {}, cell(when(e.time)), cell(e.actor), cell(e.action),
      cell(e.target), cell(e.tenant_id), cell(e.address),
      h("td", {}, h("details", {}, h("summary", {}, "before / after"),
        h("pre", {}, "before: " + JSON.stringify(e.before, null, 1)),
        h("pre", {}, "after: " + JSON.stringify(e.after, null, 1))))));
    page("Audit log", form,
      table("Admin changes, newest first", ["Time (UTC)", "Actor", "Action", "Target", "Tenant", "Address", "Change"], rows),
      log.next ? h("button", { type: "button", class: "secondary", onclick: () => showAudit(filters, log.next) }, "Older entries") : null);
  }

  // ---------------------------------------------------------------- routing

  const PAGES = {
    tenants: () => showTenants(),
    keys: (arg) => showKeys(arg),
    usage: (arg) => showUsage(arg),
    engines: () => showEngines(),
    adapters: () => showAdapters(),
    audit: () => showAudit({}),
  };

  async function route() {
    if (!state.csrf) return;
    const [name, arg] = location.hash.replace(/^#/, "").split("/");
    const show = PAGES[name] || PAGES.tenants;
    for (const a of document.querySelectorAll("#nav a")) {
      if (a.getAttribute("href") === "#" + (PAGES[name] ? name : "tenants")) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    document.getElementById("alert").textContent = "";
    document.getElementById("status").textContent = "";
    await attempt(() => show(arg ? decodeURIComponent(arg) : undefined));
  }

  async function start() {
    window.addEventListener("hashchange", route);
    document.getElementById("sign-out").addEventListener("click", async () => {
      await attempt(() => api("DELETE", "/admin/ui/session"));
      signedOut();
      say("Signed out.");
    });
    try {
      signedIn(await api("GET", "/admin/ui/session"));
      await route();
    } catch (e) {
      signedOut();
    }
  }

  start();
})();
