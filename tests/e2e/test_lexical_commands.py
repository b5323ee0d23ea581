"""BM25 over the images' own text, through the commands: an image whose caption holds a name no model learned is
found by a document naming it (built, then added through the change loop), a removed one is never returned, before
and after a compaction, and the store is verified."""

import json
import shutil
from pathlib import Path

import pytest
from repo import ROOT, run_script
from workdirs import index_collection

pytestmark = pytest.mark.slow  # index, add, remove and retrieve commands: minutes on 2 cores

CONFIG = "configs/collection.py"
LEXICAL = "--config.index.lexical.enabled=true"
NAME_CAPTION = "Councillor Quillan Ozymandias-Roe opens the Westford footbridge"
ADDED_CAPTION = "Alderwoman Zephyrine Vantablack at the Grimsby lifeboat station"


def _article(name: str) -> str:
    return (f"The town council met on Tuesday. {name} spoke about the new budget for the harbour and the "
            f"bridge, and {name} answered questions from residents about the railway station.")


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Path:
    """The example collection with one image's caption naming a person no model has seen."""
    out = tmp_path_factory.mktemp("lexical_collection")
    shutil.copytree(ROOT / "examples" / "collection", out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("more"))
    rows = [json.loads(line) for line in (out / "images.jsonl").read_text().splitlines()]
    rows[5]["caption"] = NAME_CAPTION
    (out / "images.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture(scope="module")
def built(workdir, collection, tmp_path_factory) -> tuple[Path, str]:
    w = tmp_path_factory.mktemp("lexical") / "w"
    proc = index_collection(w, CONFIG, workdir, collection, LEXICAL)
    assert "lexical" in proc.stdout and "postings" in proc.stdout, proc.stdout
    named = json.loads((collection / "images.jsonl").read_text().splitlines()[5])["id"]
    return w, named


def _hits(w: Path, text: str, tmp_path: Path, method: str) -> list[str]:
    query = tmp_path / "query.txt"
    query.write_text(text)
    proc = run_script("retrieve.py", "--index", str(w), "--query", str(query), "--format", "json", "--top-k", "10",
                      "--method", method)
    return [h["image_id"] for h in json.loads(proc.stdout.strip().splitlines()[-1])["hits"]]


def test_a_name_in_a_caption_is_found_by_a_document_naming_it(built, tmp_path):
    w, named = built
    assert _hits(w, _article("Quillan Ozymandias-Roe"), tmp_path, "bm25")[0] == named
    assert named in _hits(w, _article("Quillan Ozymandias-Roe"), tmp_path, "cfir_bm25")
    assert named in _hits(w, _article("Quillan Ozymandias-Roe"), tmp_path, "cfir_bm25_fused")
    proc = run_script("index.py", "--verify", "--workdir", str(w))
    assert "lexical" in proc.stdout, proc.stdout


def test_added_image_is_found_and_a_removed_one_never_returned(built, tmp_path):
    w0, named = built
    w = tmp_path / "w"
    shutil.copytree(w0, w, symlinks=True)
    more = tmp_path / "more"
    more.mkdir()
    example = json.loads((ROOT / "examples" / "collection" / "images.jsonl").read_text().splitlines()[0])
    shutil.copy(ROOT / "examples" / "collection" / example["path"], more / "new.png")
    (more / "images.jsonl").write_text(json.dumps({**example, "id": "img_new_zv", "path": "new.png",
                                                   "caption": ADDED_CAPTION}) + "\n")
    proc = run_script("index.py", "--workdir", str(w), "--add", str(more))
    assert "lexical: extend" in proc.stdout + proc.stderr, proc.stdout + proc.stderr  # the change loop's own step
    assert _hits(w, _article("Zephyrine Vantablack"), tmp_path, "bm25")[0] == "img_new_zv"
    ids = tmp_path / "ids.txt"
    ids.write_text(f"{named}\n")
    run_script("index.py", "--workdir", str(w), "--remove", str(ids))
    for method in ("bm25", "cfir_bm25", "cfir_bm25_fused"):
        assert named not in _hits(w, _article("Quillan Ozymandias-Roe"), tmp_path, method), method
    proc = run_script("index.py", "--workdir", str(w), "--compact")
    assert "lexical: remap" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert named not in _hits(w, _article("Quillan Ozymandias-Roe"), tmp_path, "bm25")
    assert _hits(w, _article("Zephyrine Vantablack"), tmp_path, "bm25")[0] == "img_new_zv"
    assert "lexical" in run_script("index.py", "--verify", "--workdir", str(w)).stdout
