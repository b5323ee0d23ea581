"""The page at `GET /`: paste a document, see the gallery `retrieve.py --html` draws (POST /v1/search/html).

`/#q=TEXT` (URL-encoded) fills the box and searches at once: a link to a query, and how the screenshot test drives it;
`&where=F1;F2` fills the filters on the pictures' fields (docs/filters.md) first; `&fold=0` shows near-duplicates
in a row instead of folded under the best-ranked of each group (docs/duplicates.md).
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cfir-jax: find the images of a document</title>
<style>
body{font-family:sans-serif;margin:1.5em 2em;color:#222}
h1{font-size:1.4em;margin:0 0 .4em}
textarea{width:100%;max-width:1100px;height:9em;font:14px/1.4 sans-serif;padding:.5em;box-sizing:border-box}
.row{margin:.5em 0;display:flex;gap:1em;align-items:center;flex-wrap:wrap}
button{font-size:1em;padding:.35em 1.2em}
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
<label>only pictures with <input id="where" placeholder="date<=2020-06-30; source=reuters; license in cc-by,cc0"
 style="width:28em" title="filters on the pictures' own fields, separated by ';' and joined by AND"></label>
<label title="show each group of near-identical pictures once, the others under it"><input id="fold"
 type="checkbox" checked> fold near-duplicates</label>
<button type="submit">Search</button><span id="status"></span></div>
</form>
<iframe id="gallery" title="the images" hidden></iframe>
<script>
const form = document.getElementById("form"), status = document.getElementById("status");
const gallery = document.getElementById("gallery"), box = document.getElementById("text");
async function search() {
  status.className = ""; status.textContent = "searching...";
  const t0 = performance.now();
  try {
    const r = await fetch("/v1/search/html", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({text: box.value, top_k: parseInt(document.getElementById("top_k").value || "20"),
        where: document.getElementById("where").value.split(";").map((w) => w.trim()).filter(Boolean),
        fold: document.getElementById("fold").checked})});
    if (!r.ok) {
      const e = await r.json().catch(() => ({error: r.statusText}));
      status.className = "error"; status.textContent = `${r.status}: ${e.error}`; return;
    }
    gallery.srcdoc = await r.text(); gallery.hidden = false;
    status.textContent = `answered in ${Math.round(performance.now() - t0)} ms`;
  } catch (err) { status.className = "error"; status.textContent = String(err); }
}
form.addEventListener("submit", (e) => { e.preventDefault(); search(); });
const hash = new URLSearchParams(location.hash.slice(1)), q = hash.get("q");
if (hash.get("where")) { document.getElementById("where").value = hash.get("where"); }
if (hash.get("fold") === "0") { document.getElementById("fold").checked = false; }
if (q) { box.value = q; search(); }
</script>
</body></html>
"""
