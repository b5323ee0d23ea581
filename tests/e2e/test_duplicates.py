"""Near-duplicates folded, run as a new user would (docs/duplicates.md): a collection where every image has a
planted copy (its embedding with tiny noise) indexes into groups equal to the threshold graph's components;
`retrieve.py --query`, the library, the service, its page and the client fold them, `--evaluate` and run files do
not; an add, a remove (the group's next member shows) and a compact keep the groups right."""

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from repo import run_script
from serving import Service
from workdirs import index_collection

import cfir_jax
from cfir_jax.stores.duplicates import Duplicates
from cfir_jax.stores.image_cache import ImageCache

CONFIG = "configs/collection.py"
THRESHOLD = 0.98


def _copies(path: Path, rng: np.random.Generator) -> list[dict]:
    """Each row of the images file `path` followed by its copy `<id>-copy`: the same image, the embedding with
    tiny noise (cosine ~0.9995)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for row in rows:
        e = np.asarray(row["embedding"])
        noisy = e + 0.02 * np.linalg.norm(e) / np.sqrt(len(e)) * rng.standard_normal(len(e))
        out += [row, {**row, "id": f"{row['id']}-copy", "embedding": [round(float(v), 6) for v in noisy]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return out


def _components(w: Path) -> np.ndarray:
    """The threshold graph's connected components over the live rows of W's image cache, by brute force (each
    labelled by its smallest live row; -1 removed)."""
    cache = ImageCache.open(w / "image_cache")
    x = np.asarray(cache.embeddings, np.float32)
    near, live = (x @ x.T) >= THRESHOLD, ~cache.removed
    label = np.full(len(x), -1)
    for r in range(len(x)):
        if live[r] and label[r] < 0:
            todo, label[r] = [r], r
            while todo:
                i = todo.pop()
                for j in np.flatnonzero(near[i] & live & (label < 0)):
                    label[j], _ = r, todo.append(j)
    return label


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("duplicates") / "collection"
    run_script("examples/collection/make.py", "--size", "tiny", "--documents", "3", "--out", str(source))
    rng = np.random.default_rng(0)
    _copies(source / "images.jsonl", rng)
    more = [json.loads(line) for line in (source / "more" / "images.jsonl").read_text().splitlines()]
    first = json.loads((source / "images.jsonl").read_text().splitlines()[0])
    # The next batch brings a third copy of the first image: an add joins an existing group.
    more.append({**first, "id": f"{first['id']}-late", "path": str((source / first["path"]).absolute())})
    (source / "more" / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in more))
    return source


@pytest.fixture(scope="module")
def built(workdir, collection, tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("dups") / "W"
    index_collection(w, CONFIG, workdir, collection)
    return w


def _groups_by_id(w: Path) -> dict[str, int]:
    cache, store = ImageCache.open(w / "image_cache"), Duplicates.open(w / "duplicates")
    return dict(zip(cache.ids, store.group.tolist()))


def _retrieve(w: Path, query: Path, *flags: str) -> dict:
    proc = run_script("retrieve.py", "--index", str(w), "--query", str(query), "--format", "json", *flags)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _folded_by_hand(hits: list[dict], group: dict[str, int]) -> list[tuple[str, list[str]]]:
    """The fold rule written out: each group's first hit, the later ones of its group under it."""
    out, seen = [], {}
    for h in hits:
        g = group[h["image_id"]]
        if g in seen:
            seen[g][1].append(h["image_id"])
        else:
            seen[g] = (h["image_id"], [])
            out.append(seen[g])
    return out


def test_the_planted_copies_form_one_group_each_as_the_threshold_graph_says(built):
    group = _groups_by_id(built)
    label = Duplicates.open(built / "duplicates").group
    assert np.array_equal(label, _components(built))
    copies = [i for i in group if i.endswith("-copy")]
    assert len(copies) == 12 and all(group[c] == group[c[: -len("-copy")]] for c in copies)
    assert len(set(group.values())) <= len(group) - 12


def test_a_query_shows_each_group_once_with_the_others_under_it_and_a_run_file_does_not(built, collection, tmp_path):
    query = collection / "query.txt"
    group = _groups_by_id(built)
    every = _retrieve(built, query, "--no-fold-duplicates", "--top-k", "10")["hits"]
    assert len({group[h["image_id"]] for h in every}) < len(every)  # copies rank side by side unfolded
    folded = _retrieve(built, query, "--top-k", "10")["hits"]  # the default on stdout
    by_hand = _folded_by_hand(every, group)
    assert len(by_hand) < 10  # retrieval.top_k is 10 here: folding the ten it ranks leaves fewer
    assert [h["image_id"] for h in folded[: len(by_hand)]] == [a for a, _ in by_hand]
    assert all(h["duplicates"][: len(b)] == b for h, (_, b) in zip(folded, by_hand))
    # ... so the document was retrieved again with the folded images set aside: top_k groups shown
    assert len(folded) == 10 and len({group[h["image_id"]] for h in folded}) == 10
    assert [h["rank"] for h in folded] == list(range(1, 11)) and any(h["duplicates"] for h in folded)
    assert not {d for h in folded for d in h["duplicates"]} & {h["image_id"] for h in folded}
    run = tmp_path / "run.trec"
    run_script("retrieve.py", "--index", str(built), "--query", str(query), "--output", str(run))
    assert [line.split()[2] for line in run.read_text().splitlines()] == [h["image_id"] for h in every]


def test_evaluate_counts_every_image_unless_asked(built, tmp_path):
    runs = {}
    for name, flags in (("default", ()), ("unfolded", ("--no-fold-duplicates",)), ("folded", ("--fold-duplicates",))):
        runs[name] = tmp_path / f"{name}.trec"
        run_script("retrieve.py", "--index", str(built), "--evaluate", "test", "--output", str(runs[name]), *flags)
    text = {k: v.read_text() for k, v in runs.items()}
    assert text["default"] == text["unfolded"] != text["folded"]
    assert "-copy" in text["default"]


def test_the_library_the_service_its_page_and_the_client_fold_alike(built, collection):
    text = (collection / "query.txt").read_text()
    service = Service(built, "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0")
    try:
        client = cfir_jax.Client(service.url)
        with cfir_jax.open(built) as index:
            unfolded = cfir_jax.Query(text, top_k=5, fold=False)
            folded, every = index.search(text, top_k=5), index.search(unfolded)
            assert any(h.duplicates for h in folded.hits) and not any(h.duplicates for h in every.hits)
            assert client.search(text, top_k=5) == folded and client.search(unfolded) == every
            assert client.search_many([text], ids=["query"], top_k=5) == [folded]
            image = folded.hits[0].id
            alike = index.search(image_id=image, top_k=3)
            assert client.search(image_id=image, top_k=3) == alike
            assert len({h.id.removesuffix("-copy") for h in alike.hits}) == len(alike.hits)  # one of each pair
            side_by_side = index.search(cfir_jax.Query(image_id=image, top_k=3, fold=False))
            pair = {image.removesuffix("-copy"), image.removesuffix("-copy") + "-copy"}
            assert set(side_by_side.ids[:2]) == pair  # the image and its copy side by side
            assert client.search(cfir_jax.Query(image_id=image, top_k=3, fold=False)) == side_by_side
            url = service.url + "/v1/search/image"
            for body in (json.dumps({"image_id": image, "top_k": 3, "fold": False}).encode(),
                         f"image_id={image}&top_k=3&fold=0".encode()):
                kind = "application/json" if body.startswith(b"{") else "application/x-www-form-urlencoded"
                answer = json.loads(_post(url, body, kind))
                assert [h["image_id"] for h in answer["hits"]] == side_by_side.ids
            with pytest.raises(urllib.error.HTTPError) as refused:
                _post(url, f"image_id={image}&fold=maybe".encode(), "application/x-www-form-urlencoded")
            assert refused.value.code == 422 and "fold: expected 1 or 0" in refused.value.read().decode()
        page = _post(service.url + "/v1/search/html", {"text": text, "top_k": 5})
        shown = next(h for h in folded.hits if h.duplicates)
        assert "near-duplicate" in page and shown.duplicates[0] in page
        assert "near-duplicate" not in _post(service.url + "/v1/search/html", {"text": text, "top_k": 5,
                                                                               "fold": False})
    finally:
        log = service.stop()
    assert "Traceback" not in log, log[-3000:]


def _post(url: str, body: dict | bytes, kind: str = "application/json") -> str:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": kind})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return answer.read().decode()


def test_add_remove_and_compact_keep_the_groups_right(built, collection, tmp_path):
    w = tmp_path / "W"
    shutil.copytree(built, w)
    query = collection / "query.txt"
    first = json.loads((collection / "images.jsonl").read_text().splitlines()[0])["id"]
    run_script("index.py", "--workdir", str(w), "--add", str(collection / "more"))
    group = _groups_by_id(w)
    assert group[f"{first}-late"] == group[first] == group[f"{first}-copy"]
    assert np.array_equal(Duplicates.open(w / "duplicates").group, _components(w))
    top = _retrieve(w, query, "--top-k", "3")["hits"][0]
    assert top["duplicates"]  # its copy under it
    gone = tmp_path / "gone.txt"
    gone.write_text(top["image_id"] + "\n")
    run_script("index.py", "--workdir", str(w), "--remove", str(gone))
    assert np.array_equal(Duplicates.open(w / "duplicates").group, _components(w))
    hits = _retrieve(w, query, "--top-k", "5")["hits"]
    after = next(h for h in hits if h["image_id"] == top["duplicates"][0])  # the group's next member shows
    assert after["duplicates"] == top["duplicates"][1:] and top["image_id"] not in json.dumps(hits)
    run_script("index.py", "--workdir", str(w), "--compact")
    assert np.array_equal(Duplicates.open(w / "duplicates").group, _components(w))
    assert _retrieve(w, query, "--top-k", "5")["hits"] == hits
    verified = run_script("index.py", "--workdir", str(w), "--verify")
    assert "store(s) intact" in verified.stdout
