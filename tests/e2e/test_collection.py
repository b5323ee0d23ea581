"""Your own collection (index.corpus.source='files') through the commands: a collection cut from the tiny world is
indexed with the session workdir's model (index.encoder names that workdir) and a planted document finds its own
pictures; an image folder with an unreadable file is indexed with that file skipped and listed."""

import json
import shutil
from pathlib import Path

import pytest
from repo import run_script

CONFIG = "configs/collection.py"


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collection")
    run_script("examples/collection/make.py", "--size", "tiny", "--out", str(out))
    return out


def _index(workdir: Path, model_workdir: Path, documents: Path, images: Path, *extra: str):
    return run_script("index.py", "--config", CONFIG, "--workdir", str(workdir),
                      f"--config.index.encoder={model_workdir}", f"--config.index.corpus.documents={documents}",
                      f"--config.index.corpus.images={images}", *extra)


def test_a_collection_from_files_is_indexed_with_another_workdirs_model_and_finds_its_pictures(
        workdir, collection, tmp_path):
    w = tmp_path / "w"
    _index(w, workdir, collection / "documents.jsonl", collection / "images.jsonl",
           f"--config.index.corpus.qrels={collection / 'qrels'}")
    info = json.loads((w / "index.json").read_text())
    model = json.loads((workdir / "encoder" / "manifest.json").read_text())
    # The other workdir's recorded encoder, with its fingerprints, as any outside encoder is recorded.
    assert Path(info["encoder"]) == (workdir / "encoder").absolute()
    assert info["encoder_fingerprint"]["text_fingerprint"] == model["text_fingerprint"]
    # ...and its text-trained model, which scores the queries since this workdir trains none.
    assert Path(info["model"]) == (workdir / "model").absolute()
    trained = json.loads((workdir / "model" / "manifest.json").read_text())
    assert info["model_fingerprint"]["text_fingerprint"] == trained["text_fingerprint"]
    assert (w / "corpus" / "tokenizer.spm").read_bytes() == (workdir / "corpus" / "tokenizer.spm").read_bytes()

    first = json.loads((collection / "documents.jsonl").read_text().splitlines()[0])
    relevant = {line.split()[2] for line in (collection / "qrels" / "test.qrels").read_text().splitlines()
                if line.split()[0] == first["id"]}
    proc = run_script("retrieve.py", "--config", CONFIG, "--index", str(w), "--query",
                      str(collection / "query.txt"), "--format", "json", "--top-k", "3")
    hits = [h["image_id"] for h in json.loads(proc.stdout.strip().splitlines()[-1])["hits"]]
    assert relevant and relevant <= set(hits), (relevant, hits)


def test_a_changed_model_in_the_other_workdir_is_refused_in_one_line(workdir, collection, tmp_path):
    w = tmp_path / "w"
    _index(w, workdir, collection / "documents.jsonl", collection / "images.jsonl", "--config.index.corpus.qrels=")
    info = json.loads((w / "index.json").read_text())
    info["model_fingerprint"]["text_fingerprint"] = "0" * 16  # as if W's model was retrained since
    (w / "index.json").write_text(json.dumps(info))
    proc = run_script("retrieve.py", "--config", CONFIG, "--index", str(w), "--query",
                      str(collection / "query.txt"), check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"the model at {(workdir / 'model').absolute()}" in lines[0], proc.stderr[-2000:]


def test_an_unreadable_picture_in_a_folder_is_skipped_and_listed_and_the_run_goes_on(workdir, collection, tmp_path):
    images = tmp_path / "pictures"
    (images / "sub").mkdir(parents=True)
    for p in sorted((collection / "images").glob("*.png"))[:3]:
        shutil.copy(p, images / "sub" / p.name)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    w = tmp_path / "w"
    proc = _index(w, workdir, collection / "documents.jsonl", images, "--config.index.image_cache.precomputed=",
                  "--config.index.corpus.qrels=")
    skipped = (w / "image_cache" / "skipped.tsv").read_text().splitlines()[1:]
    assert [line.split("\t")[0] for line in skipped] == ["broken"]
    ids = (w / "image_cache" / "ids.txt").read_text().split()
    assert len(ids) == 3 and all(i.startswith("sub/img") for i in ids)
    assert (w / "entity_index" / "manifest.json").is_file() and "1 skipped" in proc.stdout
