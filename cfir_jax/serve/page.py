"""The page at `GET /`: paste a document, see the gallery `retrieve.py --html` draws (POST /v1/search/html).

`/#q=TEXT` (URL-encoded) fills the box and searches at once: a link to a query, and how the screenshot test drives it;
`&where=F1;F2` fills the filters on the images' fields (docs/filters.md) first, `&pick=[[FIELD, "=", VALUE], ...]`
(JSON) the values picked from the gallery, `&top_k=N` the hits; `&fold=0` shows near-duplicates in a row instead of
folded under the best-ranked of each group (docs/duplicates.md); `/#image_id=ID` searches by that indexed image
instead.

As a picture desk uses it (docs/filters.md): the gallery shows each hit's own fields (date, source, license, tags);
the page asks the counts (facets) of the fields it has seen on hits, every kind but a number's, and shows them above
the hits; a click on a value picks it, `(field, "=", value)`, and searches again (a date's month, `date=2020-06`,
which a filter reads at month precision). A picked value is sent as the triple it is, never written into the box as
a line to be parsed again: a value's spaces, quotes, commas and semicolons are its own (the box's `;` separates its
lines, a line's value loses its outer spaces and quotes). Each picked value is a button under the form; a click on it
drops it and searches again. A click on a hit's image searches by that image (POST
/v1/search/image/html with its id and the filters: the same gallery, each hit's pixels inline as a text search's, else
its http(s) url), and a click on one of those searches again. Which fields to count is learned from the hits rather
than asked of the index: it needs no door of its own on either engine, and a collection without fields asks none and
shows what it showed before. The page draws no value of an answer itself: both galleries are the service's, each
value escaped by `cfir_jax.retrieve.report.html_page`, and an error is shown as text (textContent).
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cfir-jax: find the images of a document</title>
<style>
body{font-family:sans-serif;margin:1.5em 2em;color:#222}
h1{font-size:1.4em;margin:0 0 .4em}
textarea{width:100%;max-width:1100px;height:9em;font:14px/1.4 sans-serif;padding:.5em;box-sizing:border-box}
.row{margin:.5em 0;display:flex;gap:1em;align-items:center;flex-wrap:wrap}
button{font-size:1em;padding:.35em 1.2em}
button.picked{font-size:.85em;padding:.2em .7em}
#status{color:#555;font-size:.9em}
#status.error{color:#b00020}
iframe{width:100%;border:1px solid #ddd;min-height:300px;height:900px}
</style></head>
<body>
<h1>Find the images of a document</h1>
<p>Paste a long document (a Wikipedia section, a news article). CFIR finds its entities, gathers their candidate
images and ranks them with the document's summary. API: <code>POST /v1/search</code>, <a href="/docs">/docs</a>.</p>
<form id="form">
<textarea id="text" placeholder="Paste a document here" required></textarea>
<div class="row"><label>hits <input id="top_k" type="number" min="1" value="20" style="width:5em"></label>
<label>only images with <input id="where" placeholder="date<=2020-06-30; source=reuters; license in cc-by,cc0"
 style="width:28em" title="filters on the images' own fields, separated by ';' and joined by AND"></label>
<label title="show each group of near-identical images once, the others under it"><input id="fold"
 type="checkbox" checked> fold near-duplicates</label>
<button type="submit">Search</button><span id="status"></span></div>
<div class="row" id="picked" hidden></div>
</form>
<iframe id="gallery" title="the images" hidden></iframe>
<script>
const form = document.getElementById("form"), status = document.getElementById("status");
const gallery = document.getElementById("gallery"), box = document.getElementById("text");
const whereBox = document.getElementById("where");
let counted = [];  // the fields whose values the page counts: those seen on hits, every kind but a number's
let last = null;   // the last search (text or image), run again when a filter or a counted field is added
let picked = [];   // the values clicked in the gallery: [field, "=", value] triples, sent as they are
const pickedRow = document.getElementById("picked");
const filters = () => whereBox.value.split(";").map((w) => w.trim()).filter(Boolean);
const options = () => ({top_k: parseInt(document.getElementById("top_k").value || "20"),
  where: filters().concat(picked),
  fold: document.getElementById("fold").checked, ...(counted.length ? {facets: counted} : {})});
async function ask(url, body) {
  status.className = ""; status.textContent = "searching...";
  const t0 = performance.now();
  try {
    const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(body)});
    if (!r.ok) {
      const e = await r.json().catch(() => ({error: r.statusText}));
      status.className = "error"; status.textContent = `${r.status}: ${e.error}`; return null;
    }
    status.textContent = `answered in ${Math.round(performance.now() - t0)} ms`;
    return r;
  } catch (err) { status.className = "error"; status.textContent = String(err); return null; }
}
async function search() {
  last = search;
  const r = await ask("/v1/search/html", {text: box.value, ...options()});
  if (r) { gallery.srcdoc = await r.text(); gallery.hidden = false; }
}
async function byImage(id) {  // the gallery of the images like it, drawn as a text search's
  last = () => byImage(id);
  const r = await ask("/v1/search/image/html", {image_id: id, id: `images like ${id}`, ...options()});
  if (r) { gallery.srcdoc = await r.text(); gallery.hidden = false; }
}
function drawPicked() {  // a button per picked value, its text a text node: a click drops it and searches again
  pickedRow.replaceChildren(...picked.map((c, n) => {
    const b = document.createElement("button");
    b.type = "button"; b.className = "picked"; b.title = "drop this filter";
    b.textContent = `${c[0]} = ${JSON.stringify(c[2])} \u00d7`;
    b.addEventListener("click", () => { picked.splice(n, 1); drawPicked(); if (last) { last(); } });
    return b; }));
  pickedRow.hidden = !picked.length;
}
function addFilter(field, value) {
  if (!picked.some((c) => c[0] === field && c[2] === value)) { picked.push([field, "=", value]); drawPicked(); }
  if (last) { last(); }
}
gallery.addEventListener("load", () => {  // wires the gallery's values and images; learns the fields to count
  const d = gallery.contentDocument;
  if (!d) { return; }
  d.querySelectorAll("a.facet").forEach((a) => a.addEventListener("click", (e) => {
    e.preventDefault(); addFilter(a.dataset.field, a.dataset.value); }));
  d.querySelectorAll("img[data-image-id]").forEach((img) => {
    img.style.cursor = "pointer"; img.title = "search by this image";
    img.addEventListener("click", () => byImage(img.dataset.imageId)); });
  const seen = [...d.querySelectorAll("span.own[data-facet='1']")].map((s) => s.dataset.field);
  const fresh = [...new Set(seen)].filter((f) => !counted.includes(f));
  if (fresh.length && last) { counted = counted.concat(fresh); last(); }  // once per new field: then counted
});
form.addEventListener("submit", (e) => { e.preventDefault(); search(); });
const hash = new URLSearchParams(location.hash.slice(1)), q = hash.get("q");
if (hash.get("where")) { document.getElementById("where").value = hash.get("where"); }
if (hash.get("pick")) {  // the service says in one line what is wrong with a triple; JSON that is not is said here
  try {
    const given = JSON.parse(hash.get("pick"));
    if (!Array.isArray(given) || !given.every((c) => Array.isArray(c) && c.length === 3)) {
      throw new Error('expected [[field, "=", value], ...]');
    }
    picked = given; drawPicked();
  }
  catch (err) { status.className = "error"; status.textContent = `pick: ${err.message}`; }
}
if (hash.get("top_k")) { document.getElementById("top_k").value = hash.get("top_k"); }
if (hash.get("fold") === "0") { document.getElementById("fold").checked = false; }
if (hash.get("image_id")) { byImage(hash.get("image_id")); } else if (q) { box.value = q; search(); }
</script>
</body></html>
"""
