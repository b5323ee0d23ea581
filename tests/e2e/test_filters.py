"""Filters on the images' own fields, run as a new user would (docs/filters.md): a collection whose images carry
dates, sources, licences, tags (lists), a flag (a boolean) and times with offsets indexes; `retrieve.py --where` gives
only images that pass, top_k of them where that many pass; the library, the service and the client give the same
answers (four filters in a multipart upload too); an unknown field is one line, exit 2; an add, a remove and a
compact keep the filters right."""

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
from repo import run_script
from serving import Service
from workdirs import index_collection

import cfir_jax

CONFIG = "configs/collection.py"
# a source as a desk may write one: outer spaces, a semicolon, quotes (the page's click must filter on it as it is)
ODD_SOURCE = " ap; 'pool' "
SOURCES, LICENCES = ("reuters", ODD_SOURCE, "afp"), ("cc-by", "cc0", "all-rights")


def _fields(n: int) -> dict:
    """An image's fields as archives write them: a list (a lone string or null in some rows), a boolean, a time
    with seconds and an offset."""
    tags = [["news", "sport"], "sport", ["weather"], None, []][n % 5]
    return {"date": f"2020-{1 + n % 12:02d}-{1 + n % 28:02d}", "source": SOURCES[n % 3],
            "license": LICENCES[(n // 3) % 3], "tags": tags, "featured": n % 4 == 0,
            "taken": f"2020-06-30T{10 + n % 2}:05:{n % 60:02d}-04:00"}


def _with_fields(path: Path, fields) -> dict[str, dict]:
    """Gives every row of the images file `path` the fields `fields(n)`; returns them by image id."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = {}
    for n, row in enumerate(rows):
        row.update(fields(n))
        out[row["id"]] = fields(n)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The example collection with a date, a source and a licence on every image (its next batch, more/, with
    dates of 2021, source reuters, licence cc0 and a field of its own, credit)."""
    source = tmp_path_factory.mktemp("filters") / "collection"
    run_script("examples/collection/make.py", "--size", "tiny", "--documents", "3", "--out", str(source))
    fields = _with_fields(source / "images.jsonl", _fields)
    fields.update(_with_fields(source / "more" / "images.jsonl", lambda n: {
        "date": f"2021-03-{1 + n:02d}", "source": "reuters", "license": "cc0", "credit": "desk", "tags": "weather"}))
    return source, fields


@pytest.fixture(scope="module")
def built(workdir, collection, tmp_path_factory) -> Path:
    source, _ = collection
    w = tmp_path_factory.mktemp("filtered") / "W"
    index_collection(w, CONFIG, workdir, source)
    return w


def _retrieve(w: Path, query: Path, *flags: str, check: bool = True):
    proc = run_script("retrieve.py", "--index", str(w), "--query", str(query), "--format", "json", *flags,
                      check=check)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if check else proc


def _passes(fields: dict, where: str) -> bool:
    """The filters of these tests, written out by hand."""
    return {"date<=2020-06-30": lambda f: f["date"] <= "2020-06-30",
            "tags=sport": lambda f: "sport" in (f["tags"] or ()),
            "tags!=sport": lambda f: f["tags"] is not None and "sport" not in f["tags"],
            "featured=true": lambda f: f["featured"],
            "taken<=2020-06-30T14:05": lambda f: f["taken"].startswith("2020-06-30T10:"),
            "tags=weather": lambda f: "weather" in (f.get("tags") or ()),
            "source=reuters": lambda f: f["source"] == "reuters",
            "license in cc-by,cc0": lambda f: f["license"] in ("cc-by", "cc0"),
            "date>=2021-01-01": lambda f: f["date"] >= "2021-01-01",
            "credit=desk": lambda f: f.get("credit") == "desk"}[where](fields)


WHERE = ("date<=2020-06-30", "source=reuters", "license in cc-by,cc0")


@pytest.mark.parametrize("where", WHERE)
def test_where_gives_only_passing_images_top_k_of_them(built, collection, where):
    source, fields = collection
    query = source / "query.txt"
    base = [i for i in (built / "image_cache" / "ids.txt").read_text().split()]
    passing = [i for i in base if _passes(fields[i], where)]
    assert 0 < len(passing) < len(base)
    for method in ("cfir", "dense_summary"):
        got = _retrieve(built, query, "--method", method, "--where", where, "--top-k", "5")
        ids = [h["image_id"] for h in got["hits"]]
        assert ids and all(_passes(fields[i], where) for i in ids), (method, ids)
        assert f"filtered by {where}: {len(passing)} of {len(base)} images pass" in got["note"]
    # The whole-cache search: the unfiltered ranking's passing images, in its order, top_k of them.
    everything = _retrieve(built, query, "--method", "dense_summary", "--top-k", str(len(base)))
    expected = [h["image_id"] for h in everything["hits"] if _passes(fields[h["image_id"]], where)][:5]
    assert ids == expected and len(ids) == min(5, len(passing))


@pytest.mark.parametrize("where", ["tags=sport", "tags!=sport", "featured=true", "taken<=2020-06-30T14:05"])
def test_lists_booleans_and_times_filter_as_archives_mean_them(built, collection, where):
    """A list holds a value or not, a boolean is true or false, a time covers its minute (10:05:30-04:00 is
    14:05:30 UTC: it passes <=14:05); every passing image is returned where top_k reaches them all."""
    source, fields = collection
    base = (built / "image_cache" / "ids.txt").read_text().split()
    passing = {i for i in base if _passes(fields[i], where)}
    assert 0 < len(passing) < len(base)
    got = _retrieve(built, source / "query.txt", "--method", "dense_summary", "--where", where,
                    "--top-k", str(len(base)))
    assert {h["image_id"] for h in got["hits"]} == passing, where


def test_a_date_without_an_offset_is_read_in_index_fields_timezone(workdir, built, collection, tmp_path):
    """With America/New_York, `taken<=2020-06-30T10:05` is New York's 10:05 (14:05 UTC), which the images taken
    at 10:05:xx-04:00 pass; in UTC (the default) none does. index.py rebuilds W/image_fields when the key changes."""
    source, fields = collection
    w = tmp_path / "W"
    shutil.copytree(built, w)
    base = (w / "image_cache" / "ids.txt").read_text().split()
    where = "taken<=2020-06-30T10:05"
    assert _retrieve(w, source / "query.txt", "--method", "dense_summary", "--where", where)["hits"] == []
    index_collection(w, CONFIG, workdir, source, "--config.index.fields.timezone=America/New_York")  # the rest reused
    got = _retrieve(w, source / "query.txt", "--method", "dense_summary", "--where", where, "--top-k", str(len(base)))
    passing = {i for i in base if fields[i]["taken"].startswith("2020-06-30T10:")}
    assert passing and {h["image_id"] for h in got["hits"]} == passing


def test_filters_join_by_and_and_none_passing_is_an_empty_answer_with_a_note(built, collection):
    source, fields = collection
    flags = [f for w in WHERE for f in ("--where", w)]
    got = _retrieve(built, source / "query.txt", "--method", "dense_summary", *flags, "--top-k", "40")
    assert got["hits"] and all(all(_passes(fields[h["image_id"]], w) for w in WHERE) for h in got["hits"])
    empty = _retrieve(built, source / "query.txt", "--where", "date<1999-01-01")
    assert empty["hits"] == [] and "no image passes the filter date<1999-01-01" in empty["note"]


@pytest.mark.parametrize("where, says", [
    ("colour=red", "unknown field 'colour' (the images' fields: date, featured, license, source, tags, taken)"),
    ("tags<sport", "tags is a list of strings (a list holds a value or not); use =, != or in, not <"),
    ("date<=yesterday", "'yesterday' is not an ISO 8601 date"),
    ("source~reuters", "expected FIELD OP VALUE"),
    pytest.param("license in " + ",".join(f"v{n}" for n in range(2000)),
                 "2,000 values, over serve.max_filter_values=1,024", id="too-many-values"),
])
def test_an_unknown_field_or_a_bad_filter_is_one_line_exit_2(built, collection, where, says):
    proc = _retrieve(built, collection[0] / "query.txt", "--where", where, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr


def test_the_library_the_service_and_the_client_agree(built, collection):
    text = (collection[0] / "query.txt").read_text()
    where = ["date<=2020-06-30", "license in cc-by,cc0"]
    service = Service(built, "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0")
    try:
        client = cfir_jax.Client(service.url)
        with cfir_jax.open(built) as index:
            expected = index.search(text, top_k=5, where=where)
            assert expected.hits and client.search(text, top_k=5, where=where) == expected
            typed = [("date", "<=", "2020-06-30"), ("license", "in", ["cc-by", "cc0"])]
            assert index.search(text, top_k=5, where=typed) == expected == client.search(text, top_k=5, where=typed)
            assert client.search_many([text, text], ids=["a", "b"], top_k=5, where=where) == \
                index.search_many([text, text], ids=["a", "b"], top_k=5, where=where)
            image = expected.ids[0]
            alike = index.search(image_id=image, top_k=5, where=["source=reuters"])
            assert alike.hits and client.search(image_id=image, top_k=5, where=["source=reuters"]) == alike
            query_string = client_get_json(service.url, image)
            assert [h["image_id"] for h in query_string["hits"]] == alike.ids[:3]
            # A triple's values are its own at every door: a comma, the spaces around a value, its quotes.
            for own in ([("license", "in", ["cc-by,cc0"])], [("source", "=", " reuters ")],
                        [("source", "in", ['"reuters"', "ap,afp"])]):
                alone = index.search(text, top_k=5, where=own)
                assert not alone.hits and client.search(text, top_k=5, where=own) == alone, own
            line = _retrieve(built, collection[0] / "query.txt", "--where", "date<=2020-06-30", "--where",
                             "license in 'cc-by', cc0", "--top-k", "5")
            assert [h["image_id"] for h in line["hits"]] == expected.ids  # the line, parsed once: the same two values
            # A list and a boolean, as lines and as typed triples (their note spells the triple's False as given).
            tagged = index.search(text, top_k=5, where=["tags in sport,weather", "featured=false"])
            assert tagged.hits and client.search(text, top_k=5, where=["tags in sport,weather", "featured=false"]) \
                == tagged
            triples = [("tags", "in", ["sport", "weather"]), ("featured", "=", False)]
            assert client.search(text, top_k=5, where=triples).hits == tagged.hits == \
                index.search(text, top_k=5, where=triples).hits
            # Unfiltered and filtered requests answered side by side each keep their own rows.
            assert client.search(text, top_k=5) == index.search(text, top_k=5) != expected
        with pytest.raises(cfir_jax.CfirError, match="^filter 'colour=red': unknown field 'colour'"):
            client.search(text, top_k=5, where=["colour=red"])
    finally:
        log = service.stop()
    assert "Traceback" not in log, log[-3000:]


def test_four_filters_in_a_multipart_upload_answer_as_the_library(built, collection):
    """Each `where` of a multipart upload is a field of its own: four of them (issue 59: more than three answered
    "Too many fields") give what the library gives."""
    where = ["date>=2020-01-01", "date<=2020-12-31", "license in cc-by,cc0", "source!=afp"]
    service = Service(built, "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0")
    try:
        with cfir_jax.open(built) as index:
            image = index.search((collection[0] / "query.txt").read_text(), top_k=1).ids[0]
            expected = index.search(image_id=image, top_k=5, where=where)
        fields = [("image_id", (None, image)), ("top_k", (None, "5")), ("id", (None, "four")), ("fold", (None, "1"))]
        fields += [("where", (None, w)) for w in where]  # eight plain fields: the parser took six
        answer = httpx.post(f"{service.url}/v1/search/image", files=fields, timeout=120)
        assert answer.status_code == 200, answer.text
        assert expected.hits and [h["image_id"] for h in answer.json()["hits"]] == expected.ids
    finally:
        log = service.stop()
    assert "Traceback" not in log, log[-3000:]


def client_get_json(url: str, image_id: str) -> dict:
    """An image search as a form with repeated fields (curl -d image_id=ID -d where=...)."""
    data = urllib.parse.urlencode([("image_id", image_id), ("top_k", "3"), ("where", "source=reuters")]).encode()
    request = urllib.request.Request(f"{url}/v1/search/image", data=data,
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def test_add_remove_and_compact_keep_the_filters_right(built, collection, tmp_path):
    source, fields = collection
    w = tmp_path / "W"
    shutil.copytree(built, w)
    query = source / "query.txt"
    run_script("index.py", "--workdir", str(w), "--add", str(source / "more"))
    added = (source / "more" / "images.jsonl").read_text().splitlines()
    new = [json.loads(line)["id"] for line in added]
    for where in ("date>=2021-01-01", "credit=desk"):
        got = [h["image_id"] for h in _retrieve(w, query, "--method", "dense_summary", "--where", where,
                                                 "--top-k", "40")["hits"]]
        assert sorted(got) == sorted(new), where  # exactly the added images: the only ones of 2021, with credit
    weather = {i for i, f in fields.items() if _passes(f, "tags=weather")}
    got = _retrieve(w, query, "--method", "dense_summary", "--where", "tags=weather", "--top-k", "80")["hits"]
    assert {h["image_id"] for h in got} == weather and set(new) < weather  # a lone string added to a list field
    gone = new[:2] + [i for i in fields if i not in new][:1]
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in gone))
    run_script("index.py", "--workdir", str(w), "--remove", str(ids))
    before = {}
    for where in ("credit=desk", "source=reuters"):
        before[where] = [h["image_id"] for h in _retrieve(w, query, "--method", "dense_summary", "--where", where,
                                                           "--top-k", "40")["hits"]]
        assert before[where] and not set(before[where]) & set(gone)
        assert all(_passes(fields[i], where) for i in before[where])
    assert sorted(before["credit=desk"]) == sorted(new[2:])
    run_script("index.py", "--workdir", str(w), "--compact")
    for where, hits in before.items():
        after = [h["image_id"] for h in _retrieve(w, query, "--method", "dense_summary", "--where", where,
                                                  "--top-k", "40")["hits"]]
        assert after == hits, where
    verified = run_script("index.py", "--workdir", str(w), "--verify")
    assert "image_fields" in verified.stdout + verified.stderr


def test_a_field_of_another_type_is_refused_naming_the_field_and_the_row(built, collection, tmp_path):
    source, _ = collection
    bad = tmp_path / "bad.jsonl"
    row = json.loads((source / "more" / "images.jsonl").read_text().splitlines()[0])
    row.update(id="new-image", path=os.fspath((source / "more" / row["path"]).absolute()), date=2021)
    bad.write_text(json.dumps(row) + "\n")
    proc = run_script("index.py", "--workdir", str(built), "--add", str(bad), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{bad}:1: field 'date' is a number (2021) but earlier rows made it a date" in lines[0]


def test_evaluate_says_how_many_images_pass_from_the_answers_count(built, collection):
    """`--evaluate --where` names how many images pass: the answers' count (`Retrieval.passed`), not their note."""
    _, fields = collection
    base = (built / "image_cache" / "ids.txt").read_text().split()
    passing = [i for i in base if _passes(fields[i], "source=reuters")]
    proc = run_script("retrieve.py", "--index", str(built), "--evaluate", "test", "--where", "source=reuters")
    first = proc.stdout.splitlines()[0]
    assert first.startswith("test split, ") and \
        first.endswith(f", filtered by source=reuters: {len(passing)} of {len(base)} images pass"), first


def _own(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if v is not None}  # a null is no value: the image lacks the field


def test_the_page_shows_each_hits_fields_and_the_counts_of_the_fields_in_headless_chromium(built, collection,
                                                                                            tmp_path):
    """Each hit carries its image's own fields (nulls left out) at the library and every door of the service; in
    Chromium, the page learns the countable fields from its hits, asks their counts and shows them, value by value,
    above the hits, each hit with its fields (its screenshot: docs/images/facets.png); a search by a hit's image
    shows every hit's pixels, fields and counts (docs/images/by_image.png)."""
    from urllib.parse import quote

    from PIL import Image as PILImage

    source, fields = collection
    text = (source / "query.txt").read_text()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium is part of the test set (scripts/setup.sh test installs it)"
    service = Service(built, "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0")
    try:
        with cfir_jax.open(built) as index:
            result = index.search(text, top_k=5)
            assert result.hits and all(h.fields == _own(fields[h.id]) for h in result.hits)
            top = index.image_bytes(result.ids[0])
            alike_ids = index.search(image_id=result.ids[0], top_k=3, where=["source!=afp"]).ids  # what a click shows
            alike_pixels = {i: index.image_bytes(i) for i in alike_ids}
        assert cfir_jax.Client(service.url).search(text, top_k=5) == result  # the fields read back equal
        answer = httpx.post(f"{service.url}/v1/search", json={"text": text, "top_k": 5}, timeout=120).json()
        assert [h["fields"] for h in answer["hits"]] == [_own(fields[h.id]) for h in result.hits]
        alike = httpx.post(f"{service.url}/v1/search/image", json={"image_id": result.ids[0], "top_k": 3,
                                                                   "facets": ["source"]}, timeout=120).json()
        assert all(h["fields"] == _own(fields[h["image_id"]]) for h in alike["hits"]) and alike["facets"]["source"]
        run = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--virtual-time-budget=20000", "--window-size=1200,1400", f"{service.url}/#q={quote(text)}&top_k=8"]
        dom = html.unescape(subprocess.run([*run, "--dump-dom"], check=True, timeout=120, capture_output=True,
                                           text=True).stdout)  # the gallery is the iframe's srcdoc, escaped
        shot = tmp_path / "facets.png"
        subprocess.run([*run, f"--screenshot={shot}"], check=True, timeout=120, capture_output=True)
        run[-1] = f"{service.url}/#image_id={quote(result.ids[0])}&top_k=3&where=source!=afp"  # what a click runs
        by_image = html.unescape(subprocess.run([*run, "--dump-dom"], check=True, timeout=120, capture_output=True,
                                                text=True).stdout)
        alike_shot = tmp_path / "by_image.png"
        subprocess.run([*run, f"--screenshot={alike_shot}"], check=True, timeout=120, capture_output=True)
        pick = json.dumps([["source", "=", ODD_SOURCE]])  # what a click on that value of the gallery picks
        run[-1] = f"{service.url}/#q={quote(text)}&top_k=8&pick={quote(pick)}"
        picked_dom = html.unescape(subprocess.run([*run, "--dump-dom"], check=True, timeout=120,
                                                  capture_output=True, text=True).stdout)
        with cfir_jax.open(built) as index:
            picked_ids = index.search(text, top_k=8, where=[("source", "=", ODD_SOURCE)]).ids
    finally:
        log = service.stop()
    assert "Traceback" not in log, log[-3000:]
    for field in ("source", "license", "tags", "date", "featured"):  # asked once seen on a hit, then counted
        assert f'class="facet" data-field="{field}"' in dom, field
    assert "Counts over the" in dom and f'data-value="{fields[result.ids[0]]["source"]}"' in dom
    first = result.hits[0].fields
    assert f'data-field="source" data-facet="1">source: {first["source"]}</span>' in dom
    assert f'data-field="date" data-facet="1">date: {first["date"]}</span>' in dom
    assert f"<h1>images like {result.ids[0]}</h1>" in by_image and 'class="facet" data-field="tags"' in by_image
    drawn = by_image.split(f"<h1>images like {result.ids[0]}</h1>")[1].split("</body>")[0].split("<figure>")[1:]
    assert len(drawn) == 3 and all('data-field="source" data-facet="1">source: ' in f for f in drawn)
    assert "source: afp" not in by_image and 'data-value="afp"' not in by_image  # the filter applied
    assert picked_ids and all(fields[i]["source"] == ODD_SOURCE for i in picked_ids)
    shown = re.findall(r'data-image-id="([^"]+)"', picked_dom.split("</h1>", 2)[-1])
    assert shown == picked_ids, (shown, picked_ids)  # the page's pick is the library's triple, value as it is
    assert f'source = {json.dumps(ODD_SOURCE)} \u00d7</button>' in picked_dom  # its button
    for image_id, figure in zip(alike_ids, drawn):  # every hit's pixels, clickable to search again
        inline = f'<img src="data:image/png;base64,{base64.b64encode(alike_pixels[image_id]).decode()}"'
        assert figure.startswith(f'{inline} alt="{image_id}" data-image-id="{image_id}"'), figure[:200]
    for png, images in ((shot, [top]), (alike_shot, alike_pixels.values())):
        screen = {tuple(c) for c in np.asarray(PILImage.open(png).convert("RGB")).reshape(-1, 3)}
        for image in images:  # painted: its two commonest colours are on the screen
            pixels = np.asarray(PILImage.open(io.BytesIO(image)).convert("RGB")).reshape(-1, 3)
            colours, counts = np.unique(pixels, axis=0, return_counts=True)
            assert all(tuple(c) in screen for c in colours[np.argsort(-counts)[:2]]), png.name
