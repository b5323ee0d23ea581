"""Rendering retrieval results: a terminal table, JSON, TREC lines, and an HTML page with the images."""

from __future__ import annotations

import base64
import html
import json
from typing import Callable

from cfir_jax.retrieval import Result

FORMATS = ("table", "json", "trec")


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def table(result: Result, describe: Callable[[str], tuple[str, str]], top: int) -> str:
    lines = [f"entities: {', '.join(result.entities) or '(none)'}"]
    if result.unknown_entities:
        lines.append(f"not in the index: {', '.join(result.unknown_entities)}")
    if result.summary:
        lines.append(f"summary: {_clip(result.summary, 200)}")
    if result.note:
        lines.append(f"note: {result.note}")
    lines.append(f"candidates: {result.num_candidates:,}; " +
                 ", ".join(f"{k} {v:.1f} ms" for k, v in result.times_ms.items()))
    rows = [("rank", "image", "score", "caption / url", "brought in by")]
    for h in result.hits[:top]:
        caption, url = describe(h.image_id)
        rows.append((str(h.rank), h.image_id, f"{h.score:.4f}", _clip(caption or url, 60), ", ".join(h.entities)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def as_json(doc_id: str, result: Result, describe: Callable[[str], tuple[str, str]], top: int) -> str:
    return json.dumps({
        "id": doc_id, "entities": result.entities, "unknown_entities": result.unknown_entities,
        "summary": result.summary, "note": result.note, "num_candidates": result.num_candidates,
        "times_ms": result.times_ms,
        "hits": [{"rank": h.rank, "image_id": h.image_id, "score": h.score, "entities": list(h.entities),
                  "caption": describe(h.image_id)[0], "url": describe(h.image_id)[1]} for h in result.hits[:top]],
    }, ensure_ascii=False)


def trec_lines(doc_id: str, result: Result, tag: str, top: int) -> str:
    return "\n".join(f"{doc_id} Q0 {h.image_id} {h.rank} {h.score!r} {tag}" for h in result.hits[:top])


# Magic numbers of the formats a corpus holds (AToMiC: WebP; synthetic worlds: PNG), for the data URI's type.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


def image_mime(data: bytes) -> str:
    """The MIME type of encoded image bytes (WebP when unrecognised: AToMiC's format)."""
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return "image/webp"


def html_page(doc_id: str, result: Result, describe: Callable[[str], tuple[str, str]],
              image_bytes: Callable[[str], bytes], top: int) -> str:
    """A self-contained page: the images inline (data URIs) when the corpus has their bytes, else their URLs."""
    cards = []
    for h in result.hits[:top]:
        caption, url = describe(h.image_id)
        data = image_bytes(h.image_id)
        if data:
            src = f"data:{image_mime(data)};base64," + base64.b64encode(data).decode()
            img = f'<img src="{src}" alt="{html.escape(h.image_id)}">'
        elif url.startswith(("http://", "https://")):
            img = f'<img src="{html.escape(url)}" alt="{html.escape(h.image_id)}" loading="lazy">'
        else:
            img = '<div class="noimg">no image</div>'
        link = f'<a href="{html.escape(url)}">{html.escape(h.image_id)}</a>' if url else html.escape(h.image_id)
        cards.append(f'<figure>{img}<figcaption><b>#{h.rank}</b> {link} <code>{h.score:.4f}</code><br>'
                     f'{html.escape(_clip(caption, 160))}<br><i>{html.escape(", ".join(h.entities))}</i>'
                     '</figcaption></figure>')
    style = ("body{font-family:sans-serif;margin:2em}figure{display:inline-block;width:220px;margin:8px;"
             "vertical-align:top}img{max-width:220px;max-height:220px}.noimg{width:220px;height:120px;"
             "background:#eee;text-align:center;line-height:120px;color:#888}figcaption{font-size:12px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>CFIR: {html.escape(doc_id)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(doc_id)}</h1>"
            f"<p><b>Entities:</b> {html.escape(', '.join(result.entities) or '(none)')}</p>"
            f"<p><b>Summary:</b> {html.escape(result.summary)}</p>"
            f"{'<p><b>Note:</b> ' + html.escape(result.note) + '</p>' if result.note else ''}"
            + "".join(cards) + "</body></html>")
