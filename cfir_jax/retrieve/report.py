"""Rendering retrieval results: a terminal table, JSON, TREC lines, an HTML page with the images, and the
evaluation table (`--evaluate [--compare]`; its rows, Table 3 of the CFIR paper and beyond, are
`cfir_jax.eval.comparison`)."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from collections.abc import Callable, Sequence

import numpy as np

from cfir_jax.retrieve.results import Result
from cfir_jax.retrieve.sr import ScoredBy

EVAL_MEASURES = ("mrr@10", "recall@10", "recall@100", "recall@1000", "success@1000")


def rerank_line(rows: Sequence[EvalRow]) -> str:
    """What the third stage cost per query on the rows that ran it (p50): its features and head (counted in
    ms/query), and the document's encoding (excluded there, like every encoding); '' when no row re-ranked."""
    parts = []
    for row in rows:
        times = [r.times_ms for r in row.results if "rerank" in r.times_ms]
        if times:
            parts.append(f"{row.label}: {np.median([t['rerank'] for t in times]):.2f} ms features + head, "
                         f"{np.median([t['rerank_encode'] for t in times]):.2f} ms encoding the document")
    return ("re-rank, p50 per query: " + "; ".join(parts)) if parts else ""


def lexical_line(rows: Sequence[EvalRow]) -> str:
    """What BM25 added and cost on the rows that searched W/lexical: candidates added to ER's union per query
    (mean) and BM25's search (p50, ms per query); '' when no row read it."""
    parts = []
    for row in rows:
        times = [r.times_ms["lexical"] for r in row.results if "lexical" in r.times_ms]
        if times:
            added = np.mean([r.lexical_added for r in row.results])
            parts.append(f"{row.label}: {np.median(times):.2f} ms" + (f", +{added:,.1f} candidates beyond ER's union"
                                                                       if added else ""))
    return ("BM25 over image text, per query (search p50; candidates added, mean): " + "; ".join(parts)) if parts \
        else ""


@dataclasses.dataclass
class EvalRow:
    label: str
    metrics: dict[str, float]  # aggregate measures of EVAL_MEASURES
    results: list[Result]
    model: str  # which model encoded the queries (Retriever.model_used)
    train_time: str = "-"  # training time per epoch of that model, with its hardware (the paper's T-t)
    # What the row did with query entities the entity index never saw: 'ignore' (dropped, the paper), 'search'
    # (searched over the cache), '-' (a row that reads no entities).
    unknown_rule: str = "-"
    no_hits: int = 0  # judged topics the row returned nothing for

    def search_ms(self) -> float:
        """Mean ms/query of retrieval proper (candidate lists + scoring, the paper's ms/query, + the re-ranker's
        features and head when it ran, + BM25's search when the row reads W/lexical), encoding excluded."""
        return float(np.mean([sum(r.times_ms.get(part, 0.0) for part in ("er", "score", "rerank", "lexical"))
                              for r in self.results]))


def eval_table(rows: Sequence[EvalRow]) -> str:
    """MRR@10, recall, success, ms/query and candidates per query of each row, the training time per epoch of the
    model it used (with the hardware) and that model."""
    head = ["row", "MRR@10", "R@10", "R@100", "R@1000", "S@1000", "ms/query", "candidates/q", "unseen entities",
            "no hits", "train/epoch", "model"]
    table = [head] + [
        [r.label, *(f"{r.metrics[k]:.4f}" for k in EVAL_MEASURES), f"{r.search_ms():.2f}",
         f"{np.mean([x.num_candidates for x in r.results]):,.0f}", r.unknown_rule, f"{r.no_hits:,}", r.train_time,
         r.model] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mean_line(complete: bool) -> str:
    """Which mean the table's figures are: trec_eval -c's (the default) or the mean over topics with hits only."""
    if complete:
        return ("means over every judged topic, a topic without hits scoring 0 (trec_eval -c); 'unseen entities': "
                "ignore = dropped (the paper), search = searched over the cache")
    return ("means over the topics with hits only (trec_eval without -c, --measures trec_eval_no_c): a row that "
            "returns nothing for a topic is not charged for it; 'unseen entities': ignore = dropped (the paper), "
            "search = searched over the cache")


def sr_line(scored: Sequence[ScoredBy], results: Sequence[Sequence[Result]]) -> str:
    """How SR scored the unions, as the rows' SR front ends say (`cfir_jax.retrieve.sr.SRFrontEnd.scored_by`:
    exactly on the CPU, the paper's; exactly on the device, with the dtype of its copy; or the CPU's fast scorer with
    its measured top-k agreement with exact scoring). Rows that scored alike say it once."""
    head = "SR: " + "; ".join(dict.fromkeys(s.label for s in scored))
    fast = [s for s in scored if s.fast]
    if not fast:
        return head
    agree = [r.sr_agreement for rs in results for r in rs if r.sr_agreement is not None]
    if not agree:
        return head + "; no query had a candidate union to compare with exact scoring"
    return (head + f"; top-{fast[0].top_k} agreement with exact scoring on these {len(agree)} queries: mean "
            f"{np.mean(agree):.4f}, worst {np.min(agree):.4f}")


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def table(result: Result, top: int) -> str:
    """The terminal's view of one result: its entities, summary, note, times and first `top` hits."""
    lines = [f"entities: {', '.join(result.entities) or '(none)'}"]
    if result.unknown_entities:
        lines.append(f"not in the index: {', '.join(result.unknown_entities)}")
    if result.summary:
        lines.append(f"summary: {_clip(result.summary, 200)}")
    if result.note:
        lines.append(f"note: {result.note}")
    lines.append(f"candidates: {result.num_candidates:,}; " +
                 ", ".join(f"{k} {v:.1f} ms" for k, v in result.times_ms.items()))
    for field, counts in (result.facets or {}).items():  # the facets asked, over the images the query ranked
        lines.append(f"facet {field} (of {result.ranked:,} ranked): " +
                     (", ".join(f"{v} {n:,}" for v, n in counts.items()) or "(no image has it)"))
    rows = [("rank", "image", "score", "caption / url", "brought in by")]
    for h in result.hits[:top]:
        folded = f" (+{len(h.duplicates)} near-duplicate{'s' * (len(h.duplicates) > 1)})" if h.duplicates else ""
        rows.append((str(h.rank), h.id + folded, f"{h.score:.4f}", _clip(h.caption or h.url, 60),
                     ", ".join(h.entities)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def shown(result: Result, fmt: str, top: int, tag: str = "cfir") -> str:
    """One result as the command shows it on stdout (`--format`): a table, a JSON line or TREC lines (`tag`), its
    first `top` hits."""
    if fmt == "table":
        return table(result, top)
    return as_json(result, top) if fmt == "json" else trec_lines(result, tag, top)


def as_json(result: Result, top: int) -> str:
    """One result as a JSON line, its first `top` hits: the record's JSON (`cfir_jax.retrieve.results.Result`)."""
    return json.dumps(dataclasses.replace(result, hits=result.hits[:top]).to_json(), ensure_ascii=False)


def unknown_summary(results: Sequence[Result], policy: str) -> str:
    """One line: how many query entities the entity index had never seen, over all results, and what became of them.

    With the paper's protocol (index built from the train documents) these are the test entities it drops
    (policy 'ignore'); 'search' finds their candidates over the cache at query time.
    """
    total = sum(len(r.entities) for r in results)
    unknown = sum(len(r.unknown_entities) for r in results)
    topics = sum(bool(r.unknown_entities) for r in results)
    share = f" ({100 * unknown / total:.1f}%)" if total else ""
    what = "searched over the cache" if policy == "search" else "ignored"
    return (f"unknown query entities: {unknown:,} of {total:,}{share}, in {topics:,} of {len(results):,} topics; "
            f"{what} (retrieval.unknown_entities={policy})")


def unknown_rules_line(rules: dict[str, tuple[Sequence[Result], Sequence[str]]]) -> str:
    """One line: how many query entities the index never saw, and per rule ('ignore', 'search') how many of them it
    dropped or searched and in which rows. rules: rule -> (one row's results under it, the labels of its rows)."""
    results = next(iter(rules.values()))[0]
    total = sum(len(r.entities) for r in results)
    unknown = sum(len(r.unknown_entities) for r in results)
    topics = sum(bool(r.unknown_entities) for r in results)
    share = f" ({100 * unknown / total:.1f}%)" if total else ""
    parts = []
    for rule in sorted(rules):
        n = sum(len(r.unknown_entities) for r in rules[rule][0])
        what = "dropped" if rule == "ignore" else "searched over the cache"
        parts.append(f"{rule}: {n:,} {what} in {', '.join(rules[rule][1])}")
    return (f"unknown query entities: {unknown:,} of {total:,}{share}, in {topics:,} of {len(results):,} topics; "
            + "; ".join(parts))


def trec_lines(result: Result, tag: str, top: int) -> str:
    """The first `top` hits as TREC run lines."""
    return "\n".join(f"{result.id} Q0 {h.id} {h.rank} {h.score!r} {tag}" for h in result.hits[:top])


# Magic numbers of the formats a corpus holds (AToMiC: WebP; synthetic worlds: PNG), for the data URI's type.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


def image_mime(data: bytes) -> str:
    """The MIME type of encoded image bytes (WebP when unrecognised: AToMiC's format)."""
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return "image/webp"


def _folded(ids: Sequence[str], image_bytes: Callable[[str], bytes], thumbs: int = 4) -> str:
    """The near-duplicates folded under a hit (docs/duplicates.md): "+N near-duplicates", the first few as small
    thumbnails (their ids as titles), the rest named."""
    if not ids:
        return ""
    small = []
    for i in ids[:thumbs]:
        data = image_bytes(i)
        small.append(f'<img src="data:{image_mime(data)};base64,{base64.b64encode(data).decode()}" '
                     f'alt="{html.escape(i)}" title="{html.escape(i)}">' if data else f"<code>{html.escape(i)}</code> ")
    rest = f' and {html.escape(", ".join(ids[thumbs:]))}' if len(ids) > thumbs else ""
    word = "near-duplicate" if len(ids) == 1 else "near-duplicates"
    return f'<div class="dups">+{len(ids)} {word}: {"".join(small)}{rest}</div>'


def _own_fields(fields) -> str:
    """A hit's own fields (date, source, license, tags, ...), each a span the service's page reads: its field
    (data-field) and whether it can be counted (data-facet: every kind but a number's, docs/filters.md)."""
    spans = []
    for name, value in fields.items():
        shown = (", ".join(map(str, value)) or "(none)") if isinstance(value, list) else str(value).lower() \
            if isinstance(value, bool) else str(value)
        facet = "0" if isinstance(value, (int, float)) and not isinstance(value, bool) else "1"
        spans.append(f'<span class="own" data-field="{html.escape(name)}" data-facet="{facet}">'
                     f'{html.escape(name)}: {html.escape(shown)}</span>')
    return f'<div class="fields">{"; ".join(spans)}</div>' if spans else ""


def _facets(result: Result) -> str:
    """The counts of the facets asked (over the images ranked), each value a link the page turns into a filter."""
    if not result.facets:
        return ""
    rows = []
    for name, counts in result.facets.items():
        values = " ".join(f'<a href="#" class="facet" data-field="{html.escape(name)}" data-value="{html.escape(v)}">'
                          f'{html.escape(v)}</a>&nbsp;({n:,})' for v, n in counts.items())
        rows.append(f"<p><b>{html.escape(name)}</b>: {values or '(no image has it)'}</p>")
    return f'<div class="facets"><p>Counts over the {result.ranked or 0:,} images ranked:</p>{"".join(rows)}</div>'


def html_page(result: Result, image_bytes: Callable[[str], bytes], top: int) -> str:
    """A self-contained page: the images inline (data URIs) when the corpus has their bytes, else their URLs; each
    hit's own fields and the facets asked, when there are."""
    cards = []
    doc_id = result.id
    for h in result.hits[:top]:
        caption, url = h.caption, h.url
        data = image_bytes(h.id)
        if data:
            src = f"data:{image_mime(data)};base64," + base64.b64encode(data).decode()
            img = f'<img src="{src}" alt="{html.escape(h.id)}" data-image-id="{html.escape(h.id)}">'
        elif url.startswith(("http://", "https://")):
            img = f'<img src="{html.escape(url)}" alt="{html.escape(h.id)}" data-image-id="{html.escape(h.id)}" ' \
                  'loading="lazy">'
        else:
            img = '<div class="noimg">no image</div>'
        link = f'<a href="{html.escape(url)}">{html.escape(h.id)}</a>' if url else html.escape(h.id)
        cards.append(f'<figure>{img}<figcaption><b>#{h.rank}</b> {link} <code>{h.score:.4f}</code><br>'
                     f'{html.escape(_clip(caption, 160))}<br><i>{html.escape(", ".join(h.entities))}</i>'
                     f'{_own_fields(h.fields)}{_folded(h.duplicates, image_bytes)}</figcaption></figure>')
    style = ("body{font-family:sans-serif;margin:2em}figure{display:inline-block;width:220px;margin:8px;"
             "vertical-align:top}img{max-width:220px;max-height:220px}.noimg{width:220px;height:120px;"
             "background:#eee;text-align:center;line-height:120px;color:#888}figcaption{font-size:12px}"
             ".dups{margin-top:4px;color:#555}.dups img{width:40px;height:40px;object-fit:cover;margin:2px 2px 0 0;"
             "border:1px solid #ccc}.fields{margin-top:4px;color:#333}.facets{font-size:13px}")
    document = (f"<p><b>Entities:</b> {html.escape(', '.join(result.entities) or '(none)')}</p>"
                f"<p><b>Summary:</b> {html.escape(result.summary)}</p>") if result.summary else ""  # an image: none
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>CFIR: {html.escape(doc_id)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(doc_id)}</h1>{document}"
            f"{'<p><b>Note:</b> ' + html.escape(result.note) + '</p>' if result.note else ''}"
            + _facets(result) + "".join(cards) + "</body></html>")
