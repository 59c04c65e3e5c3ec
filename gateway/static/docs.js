"use strict";
// A small, dependency-free explorer: reads /openapi.json, lists operations by tag, sends
// requests with the API key typed above (kept in this page only, never stored).
(function () {
  const main = document.getElementById("paths");
  const filter = document.getElementById("filter");
  let spec = null;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => node.setAttribute(k, v));
    children.forEach((c) => node.append(c));
    return node;
  }

  function resolve(schema) {
    if (schema && schema.$ref) {
      const name = schema.$ref.split("/").pop();
      return spec.components.schemas[name] || schema;
    }
    return schema;
  }

  async function send(method, path, bodyText, mediaType, out) {
    const headers = {};
    const token = document.getElementById("token").value.trim();
    if (token) headers["Authorization"] = "Bearer " + token;
    const init = { method: method.toUpperCase(), headers };
    if (bodyText && bodyText.trim()) {
      headers["Content-Type"] = mediaType;
      init.body = bodyText;
    }
    out.textContent = "...";
    try {
      const res = await fetch(path, init);
      const text = await res.text();
      out.textContent = res.status + " " + res.statusText + "\n\n" + text;
    } catch (err) {
      out.textContent = String(err);
    }
  }

  function operation(path, method, op) {
    const box = el("details");
    box.append(el("summary", {}, el("span", { class: "method " + method }, method.toUpperCase()),
      el("code", {}, path), " " + (op.summary || "")));
    const target = el("input", { value: path, size: "60" });
    box.append(el("p", {}, "Request path: ", target));
    let body = null;
    // The body's first media type: most take JSON, the OAuth token endpoint a form.
    const [mediaType, media] = Object.entries((op.requestBody || {}).content || {})[0] || [];
    if (mediaType) {
      const json = mediaType === "application/json";
      box.append(el("p", {}, "Body (" + mediaType + "):"));
      if (media && media.schema) {
        box.append(el("pre", {}, JSON.stringify(resolve(media.schema), null, 2)));
      }
      body = el("textarea", {}, json ? "{}" : "");
      box.append(body);
    }
    const out = el("pre", {}, "");
    const button = el("button", { type: "button" }, "Send");
    button.addEventListener("click", () =>
      send(method, target.value, body && body.value, mediaType, out));
    box.append(button, out);
    return box;
  }

  function render() {
    const needle = filter.value.trim().toLowerCase();
    const byTag = {};
    Object.entries(spec.paths).forEach(([path, ops]) => {
      if (needle && !path.toLowerCase().includes(needle)) return;
      Object.entries(ops).forEach(([method, op]) => {
        const tag = (op.tags && op.tags[0]) || "Other";
        (byTag[tag] = byTag[tag] || []).push(operation(path, method, op));
      });
    });
    main.replaceChildren();
    Object.keys(byTag).sort().forEach((tag) => {
      main.append(el("h2", {}, tag), ...byTag[tag]);
    });
  }

  fetch("/openapi.json").then((r) => r.json()).then((doc) => {
    spec = doc;
    document.getElementById("title").textContent = doc.info.title;
    document.getElementById("version").textContent =
      "API " + doc.info.version + " - " + (doc.info.description || "");
    render();
  }).catch((err) => { main.textContent = "could not load /openapi.json: " + err; });
  filter.addEventListener("input", () => spec && render());
})();
