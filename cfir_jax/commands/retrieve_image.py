"""Search by picture (`retrieve.py --query-image photo.jpg` / `--query-image-id ID`): a picture's nearest pictures
over the index's live rows, through the library's `Index.search(image=...)`, shown as `--query`'s hits are (a table,
JSON or TREC lines; optionally an HTML page)."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_collections

from cfir_jax.api.index import Index
from cfir_jax.retrieve import report


def run(config: ml_collections.ConfigDict, workdir, method: str, *, image: str = "", image_id: str = "",
        fmt: str = "table", shown: int = 20, html: str = "", tag: str = "cfir", where: list[str] | None = None,
        fold: bool = True, facets: list[str] | None = None) -> None:
    """Searches by the picture file `image` or the indexed picture `image_id` and prints `shown` hits in `fmt`,
    near-duplicates folded under their best-ranked one (`fold`), `facets` counted over what it ranked."""
    index = Index(config, workdir, method)  # the picture is read before minutes of loading, then the stores open
    result = index.search(image=Path(image) if image else None, image_id=image_id or None, top_k=shown,
                          where=where, fold=fold, facets=facets)
    sys.stderr.write("".join(f"note: {note}\n" for note in index.notes))  # what the retriever decided
    print(report.shown(result, fmt, shown, tag))
    if html:
        Path(html).write_text(report.html_page(result, index.picture, shown), encoding="utf-8")
        print(f"wrote {html}", file=sys.stderr)
