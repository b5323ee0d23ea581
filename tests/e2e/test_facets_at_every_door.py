"""Facets on a real index (issue 61 item 4; docs/filters.md), run as a new user would: a collection whose images
carry a source, tags (a list) and a date indexes; `retrieve.py --facets`, the library and the service (and the
client) give equal counts over every image the query ranked (CFIR: the union SR scored; a dense method: its ranking
up to retrieval.top_k), not only the shown top_k; a single-valued field's counts sum to `ranked`; a date counts by
month; a filter's facets count only passing images; search by image counts too; an unknown field is one line,
exit 2."""

import json
from pathlib import Path

import pytest
from repo import run_script
from serving import Service
from workdirs import index_collection

import cfir_jax
from cfir_jax import Query

CONFIG = "configs/collection.py"
SOURCES = ("reuters", "ap", "afp")
FACETS = ["source", "tags", "date"]


def _fields(n: int) -> dict:
    return {"source": SOURCES[n % 3], "tags": [["news", "sport"], "sport", ["weather"], None, []][n % 5],
            "date": f"2020-{1 + n % 4:02d}-{1 + n % 28:02d}T12:00:00Z", "rating": n % 7}


@pytest.fixture(scope="module")
def built(workdir, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the workdir, the collection, each image's fields by id)."""
    source = tmp_path_factory.mktemp("facets") / "collection"
    run_script("examples/collection/make.py", "--size", "tiny", "--documents", "3", "--out", str(source))
    path = source / "images.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    fields = {}
    for n, row in enumerate(rows):
        row.update(_fields(n))
        fields[row["id"]] = _fields(n)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = tmp_path_factory.mktemp("faceted") / "W"
    index_collection(w, CONFIG, workdir, source)
    return w, source, fields


def _retrieve(w: Path, *flags: str, check: bool = True):
    proc = run_script("retrieve.py", "--index", str(w), "--format", "json", *flags, check=check)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if check else proc


def test_facets_count_what_the_query_ranked_equal_at_every_door(built):
    w, source, fields = built
    text = (source / "query.txt").read_text()
    service = Service(w, "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0",
                      "--config.serve.methods=cfir,dense_summary")
    try:
        client = cfir_jax.Client(service.url)
        with cfir_jax.open(w) as index:
            for method in ("cfir", "dense_summary"):
                got = index.search(Query(text, top_k=3, method=method, facets=FACETS, fold=False))
                assert len(got.hits) <= 3 < got.ranked, (method, got.ranked)  # every image ranked, not the shown
                if method == "cfir" and got.entities:
                    assert got.ranked == got.num_candidates  # CFIR: the union SR scored
                assert sum(got.facets["source"].values()) == got.ranked  # one value each, every image has one
                assert set(got.facets["date"]) <= {"2020-01", "2020-02", "2020-03", "2020-04"}
                assert sum(got.facets["date"].values()) == got.ranked
                assert set(got.facets["tags"]) <= {"news", "sport", "weather"}
                assert client.search(Query(text, top_k=3, method=method, facets=FACETS, fold=False)) == got
                line = _retrieve(w, "--query", str(source / "query.txt"), "--method", method, "--top-k", "3",
                                 "--facets", ",".join(FACETS), "--no-fold-duplicates")
                assert (line["facets"], line["ranked"]) == (got.facets, got.ranked), method
            folded = index.search(text, top_k=3, facets=FACETS)  # near-duplicates folded count once
            assert folded.ranked <= index.search(Query(text, top_k=3, facets=FACETS, fold=False)).ranked
            assert client.search(Query(text, top_k=3, facets=FACETS)) == folded
            # Under a filter, only the passing images count.
            only = index.search(Query(text, top_k=3, method="dense_summary", where=["source=ap"],
                                     facets=["source", "tags"]))
            assert only.facets["source"] == {"ap": only.ranked} and only.ranked == only.passed
            assert client.search(Query(text, top_k=3, method="dense_summary", where=["source=ap"],
                                       facets=["source", "tags"])) == only
            # Search by image counts its ranking too.
            image = got.ids[0]
            alike = index.search(Query(image_id=image, top_k=2, facets=["source"], fold=False))
            assert alike.ranked > 2 and sum(alike.facets["source"].values()) == alike.ranked
            assert client.search(Query(image_id=image, top_k=2, facets=["source"], fold=False)) == alike
            # An answer without facets has neither key.
            plain = client.search(text, top_k=3)
            assert plain.facets is None and plain == index.search(text, top_k=3)
        with pytest.raises(cfir_jax.CfirError, match="^facets: unknown field 'colour'"):
            client.search(Query(text, top_k=3, facets=["colour"]))
        with pytest.raises(cfir_jax.CfirError, match="^facets: rating is a number field"):
            client.search(Query(image_id=image, top_k=3, facets=["rating"]))
    finally:
        log = service.stop()
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("facets, says", [
    ("colour", "facets: unknown field 'colour' (the images' fields: date, rating, source, tags)"),
    ("source,rating", "facets: rating is a number field, which is not counted"),
])
def test_an_unknown_or_a_number_facet_field_is_one_line_exit_2(built, facets, says):
    w, source, fields = built
    for asked in (["--query", str(source / "query.txt")], ["--query-image-id", next(iter(fields))]):
        proc = _retrieve(w, *asked, "--facets", facets, check=False)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], (asked, proc.stderr)
