"""Your own collection (index.corpus.source='files') through the commands: a collection cut from the tiny world is
indexed with the session workdir's model (index.encoder names that workdir) and a planted document finds its own
images; an image folder with an unreadable file is indexed with that file skipped and listed; a folder of
images named as people name them (spaces, nested folders, a GIF) is indexed, and images handed to --add beside a
documents file are added with it."""

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


def test_a_collection_from_files_is_indexed_with_another_workdirs_model_and_finds_its_images(
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


def test_an_unreadable_image_in_a_folder_is_skipped_and_listed_and_the_run_goes_on(workdir, collection, tmp_path):
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    for p in sorted((collection / "images").glob("*.png"))[:3]:
        shutil.copy(p, images / "sub" / p.name)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    w = tmp_path / "w"
    proc = _index(w, workdir, collection / "documents.jsonl", images, "--config.index.image_cache.precomputed=",
                  "--config.index.corpus.qrels=")
    skipped = (w / "image_cache" / "skipped.tsv").read_text().splitlines()[1:]
    assert [line.split("\t")[0] for line in skipped] == ["broken"]
    ids = (w / "image_cache" / "ids.txt").read_text().split()
    assert len(ids) == 3 and all(i.startswith("sub/img") for i in ids)
    assert (w / "entity_index" / "manifest.json").is_file() and "1 skipped" in proc.stdout


def _photos(collection: Path, root: Path) -> Path:
    """A folder as a user has one: nested folders, names with spaces, a GIF, a broken and an empty file."""
    from PIL import Image as PILImage

    pngs = sorted((collection / "images").glob("*.png"))
    (root / "people").mkdir(parents=True)
    (root / "trips" / "summer 2019").mkdir(parents=True)
    shutil.copy(pngs[0], root / "people" / "Grace Hopper.png")
    shutil.copy(pngs[1], root / "trips" / "summer 2019" / "the beach.png")
    PILImage.open(pngs[2]).convert("P").save(root / "trips" / "a gif.gif")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    (root / "empty.png").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def photos(workdir, collection, tmp_path_factory) -> tuple[Path, str]:
    """The folder of `_photos` indexed with the session workdir's model: (the workdir, what index.py printed)."""
    root = tmp_path_factory.mktemp("photos")
    proc = _index(root / "w", workdir, collection / "documents.jsonl", _photos(collection, root / "photos"),
                  "--config.index.image_cache.precomputed=", "--config.index.corpus.qrels=")
    return root / "w", proc.stdout


def test_a_folder_of_images_named_as_people_name_them_is_indexed(photos, collection):
    w, out = photos
    skipped = (w / "image_cache" / "skipped.tsv").read_text().splitlines()[1:]
    assert [line.split("\t")[0] for line in skipped] == ["broken", "empty"] and "2 skipped" in out
    ids = (w / "image_cache" / "ids.txt").read_text().split("\n")[:-1]
    assert ids == ["people/Grace%20Hopper", "trips/a%20gif", "trips/summer%202019/the%20beach"]
    proc = run_script("retrieve.py", "--config", CONFIG, "--index", str(w), "--query", str(collection / "query.txt"),
                      "--format", "json", "--top-k", "3")
    hits = [h["image_id"] for h in json.loads(proc.stdout.strip().splitlines()[-1])["hits"]]
    assert sorted(hits) == ids


def test_an_add_reads_the_images_beside_its_documents_file(photos, collection, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(photos[0], w)
    new = tmp_path / "new"
    new.mkdir()
    (new / "documents.jsonl").write_text(json.dumps({"id": "doc-new", "text": "Grace Hopper at the harbour."}) + "\n")
    for k, png in enumerate(sorted((collection / "images").glob("*.png"))[3:6]):
        shutil.copy(png, new / f"new image {k}.png")
    proc = run_script("index.py", "--workdir", str(w), "--add", str(new))
    assert "images added 3" in proc.stdout and "documents added 1" in proc.stdout, proc.stdout
    ids = (w / "image_cache" / "ids.txt").read_text().split("\n")[:-1]
    assert ids[3:] == [f"new%20image%20{k}" for k in range(3)]
    (new / "images").mkdir()  # images beside an images/ folder would be ignored: refused, naming them
    shutil.move(new / "new image 0.png", new / "images" / "inside.png")
    proc = run_script("index.py", "--workdir", str(w), "--add", str(new), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "new image 1.png" in lines[0], proc.stderr[-2000:]
    assert json.loads((w / "index.json").read_text())["version"] == 2
