// The operator API's reference, drawn from its OpenAPI schema (no CDN, no library).
"use strict";
(async function () {
  const main = document.getElementById("docs");
  const answer = await fetch("/ctx/openapi.json");
  if (!answer.ok) { main.textContent = "Could not read /ctx/openapi.json: " + answer.status; return; }
  const api = await answer.json();
  main.textContent = "";
  const h = (tag, text, cls) => { const e = document.createElement(tag); if (text) e.textContent = text; if (cls) e.className = cls; return e; };
  main.append(h("h1", api.info.title + " " + api.info.version));
  main.append(h("p", "Every path is under /ctx. With an admin token set, send Authorization: Bearer <token>.", "muted"));
  for (const [path, methods] of Object.entries(api.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const box = h("section", null, "endpoint");
      box.append(h("h2", method.toUpperCase() + " /ctx" + path));
      if (op.description || op.summary) box.append(h("p", op.description || op.summary));
      const params = (op.parameters || []).map(p => p.name + " (" + p.in + (p.required ? ", required" : "") + ")");
      if (params.length) box.append(h("p", "Parameters: " + params.join(", "), "muted"));
      if (op.requestBody) box.append(h("p", "Body: JSON", "muted"));
      main.append(box);
    }
  }
})();
