"""Search by picture (`retrieve.py --query-image photo.jpg` / `--query-image-id ID`): a picture's nearest pictures
over the index's live rows, shown as `--query`'s hits are (a table, JSON or TREC lines; optionally an HTML page)."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_collections

from cfir_jax.retrieve import report
from cfir_jax.retrieve.image_query import prepare, read_picture, search_image
from cfir_jax.retrieve.pipeline import Retriever
from cfir_jax.stores import versions
from cfir_jax.stores.layout import Layout


def run(config: ml_collections.ConfigDict, workdir, method: str, *, image: str = "", image_id: str = "",
        fmt: str = "table", shown: int = 20, html: str = "", tag: str = "cfir", where: list[str] | None = None
        ) -> None:
    """Searches by the picture file `image` or the indexed picture `image_id` and prints `shown` hits in `fmt`."""
    data = read_picture(image, int(config.serve.max_image_bytes)) if image else None  # before minutes of loading
    with versions.reading(Layout.of(workdir)):  # the Retriever's stores and the picture search's, one version
        retriever = Retriever(config, workdir, method)
        prepare(retriever)
    for note in retriever.notes:  # as --query prints them
        print(f"note: {note}", file=sys.stderr)
    result = search_image(retriever, image=data, image_id=image_id or None, top_k=shown,
                          max_pixels=int(config.serve.max_image_pixels), where=where)
    query_id = image_id or Path(image).stem or "picture"
    describe = retriever.describe_image
    if fmt == "table":
        print(report.table(result, describe, shown))
    elif fmt == "json":
        print(report.as_json(query_id, result, describe, shown))
    else:
        print(report.trec_lines(query_id, result, tag, shown))
    if html:
        row = {i: n for n, i in enumerate(retriever.corpus.image_ids)}
        image_bytes = lambda i: retriever.corpus.image(row[i]).image if i in row else b""  # noqa: E731
        Path(html).write_text(report.html_page(query_id, result, describe, image_bytes, shown))
        print(f"wrote {html}", file=sys.stderr)
