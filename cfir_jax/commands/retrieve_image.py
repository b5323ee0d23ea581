"""Search by image (`retrieve.py --query-image photo.jpg` / `--query-image-id ID`): an image's nearest images
over the index's live rows, through the library's `Index.search(image=...)`, shown as `--query`'s hits are (a table,
JSON or TREC lines; optionally an HTML page)."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_collections

from cfir_jax.api.index import Index
from cfir_jax.commands.retrieve import Shown
from cfir_jax.core.query_rule import Query
from cfir_jax.retrieve import report


def run(config: ml_collections.ConfigDict, workdir, query: Query, shown: Shown) -> None:
    """Searches by the image of `query` (its file or an indexed image's id; the flags' Query, `query.top_k` the
    hits shown) by `query.method` and prints its hits as `shown` says, near-duplicates folded under their
    best-ranked one unless not `query.fold`, `query.facets` counted over what it ranked."""
    index = Index(config, workdir, query.method)  # the image is read before minutes of loading, then the stores open
    result = index.search(query)
    sys.stderr.write("".join(f"note: {note}\n" for note in index.notes))  # what the retriever decided
    print(report.shown(result, shown.fmt, query.top_k, shown.tag))
    if shown.html:
        Path(shown.html).write_text(report.html_page(result, index.image_bytes, query.top_k), encoding="utf-8")
        print(f"wrote {shown.html}", file=sys.stderr)
