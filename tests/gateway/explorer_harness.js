"use strict";
// Runs the API explorer (gateway/static/docs.js) under node with just enough of a DOM for
// it: argv[2] is the script, argv[3] the OpenAPI document it fetches. Prints what it drew.
const fs = require("fs");
const vm = require("vm");

const created = [];
class Node {
  constructor(tag) { this.tag = tag; this.children = []; this.attrs = {}; this.text = ""; }
  setAttribute(k, v) { this.attrs[k] = v; }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  addEventListener() {}
  set textContent(v) { this.text = String(v); this.children = []; }
  get textContent() { return this.text; }
}
const byId = {};
for (const id of ["paths", "filter", "token", "title", "version"]) byId[id] = new Node("div");
byId.filter.value = "";
byId.token.value = "";
const document = {
  getElementById: (id) => byId[id],
  createElement: (tag) => { const n = new Node(tag); created.push(n); return n; },
};
const doc = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
const fetch = async () => ({ json: async () => doc });
vm.runInNewContext(fs.readFileSync(process.argv[2], "utf8"), { document, fetch, console });
setTimeout(() => {
  const main = byId.paths;
  console.log(JSON.stringify({
    error: main.text,
    sections: main.children.filter((n) => n.tag === "h2").length,
    operations: main.children.filter((n) => n.tag === "details").length,
    textareas: created.filter((n) => n.tag === "textarea").length,
  }));
}, 50);
