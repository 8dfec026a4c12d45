// Refreshes the server-rendered status page from /status.json every few seconds. Values are
// written with textContent only (never innerHTML): ids and reasons come from database rows.
"use strict";
(function () {
  var EVERY_MS = 5000, W = 600, H = 120, WINDOW_S = 3600, refreshes = 0;
  function get(obj, path) {
    return path.split(".").reduce(function (o, k) { return o == null ? o : o[k]; }, obj);
  }
  function secs(v) { return v == null ? "\u2014" : v.toFixed(1) + " s"; }
  function show(key, v) {
    if (v == null) return "\u2014";
    if (key === "ready") return v ? "yes" : "no";
    if (key === "slot.lag_seconds") return secs(v);
    if (key === "slot.lag_bytes") return String(Math.round(v));
    if (key === "events.rate_per_second") return v.toFixed(1);
    if (Array.isArray(v)) return v.join(", ");
    return String(v);
  }
  function rows(id, items, cells) {
    var body = document.querySelector("#" + id + " tbody");
    if (!body) return;
    while (body.firstChild) body.removeChild(body.firstChild);
    items.forEach(function (item) {
      var tr = document.createElement("tr");
      cells(item).forEach(function (c, i) {
        var td = document.createElement("td");
        td.textContent = c;
        if (id === "parked" && i === 0) td.className = "id";
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
  }
  function chart(samples) {
    var line = document.getElementById("lag-line");
    if (!line || !samples.length) return;
    var last = samples[samples.length - 1].at, max = 1;
    samples.forEach(function (s) { max = Math.max(max, s.lag_bytes); });
    line.setAttribute("points", samples.map(function (s) {
      var x = W - (last - s.at) / WINDOW_S * W, y = H - s.lag_bytes / max * H;
      return x.toFixed(1) + "," + y.toFixed(1);
    }).join(" "));
    var dot = document.getElementById("lag-dot"), s = samples[samples.length - 1];
    dot.setAttribute("r", "3");
    dot.setAttribute("cx", W.toFixed(1));
    dot.setAttribute("cy", (H - s.lag_bytes / max * H).toFixed(1));
    document.getElementById("lag-max").textContent = String(Math.round(max === 1 ? 0 : max));
  }
  function apply(f) {
    document.querySelectorAll("[data-k]").forEach(function (el) {
      el.textContent = show(el.getAttribute("data-k"), get(f, el.getAttribute("data-k")));
    });
    var role = document.querySelector("h1 .role");
    if (role) role.className = "role role-" + f.role;
    document.title = "outboxd " + f.role + " \u00b7 " + f.slot.name;
    rows("oldest", f.oldest_undelivered, function (t) { return [t.event_type, secs(t.age_seconds)]; });
    rows("parked", f.parked.events, function (p) {
      return [p.event_id, p.aggregate_type + "/" + p.aggregate_id, p.event_type, p.state,
              p.reason_class, secs(p.age_seconds), p.fix];
    });
    rows("errors", f.errors.last, function (e) { return [e.at, e.class, e.message, e.fix]; });
    document.getElementById("error-counts").textContent = Object.keys(f.errors.counts)
      .map(function (k) { return k + "=" + f.errors.counts[k]; }).join(", ");
    document.getElementById("config").textContent = JSON.stringify(f.config, null, 2);
    chart(f.lag_history);
    refreshes += 1;
    document.body.setAttribute("data-refreshes", String(refreshes));
    document.getElementById("refreshed").textContent = "live: updated " + f.generated_at;
  }
  function refresh() {
    fetch("status.json" + location.search, { cache: "no-store", credentials: "same-origin" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(apply)
      .catch(function (e) {
        document.getElementById("refreshed").textContent = "refresh failed (" + e.message + "); showing the last values";
      });
  }
  refresh();
  setInterval(refresh, EVERY_MS);
})();
