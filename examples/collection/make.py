"""Regenerates examples/collection/: a small collection of plain files cut from the demo's synthetic world.

    python examples/collection/make.py                       # this folder, from the demo world (configs/demo.py)
    python examples/collection/make.py --size tiny --out DIR # from the tests' tiny world (configs/demo.py:tiny)

It writes 10 documents of the world's test split (documents.jsonl: id, title, text), about 40 of its images as
PNG files (images/<id>.png: each document's relevant images, then other images of the entities it mentions), a
captions file (images.jsonl: id, path, caption, and the world's precomputed embedding of the image, which is what
the demo's frozen vision tower stands for), the relevance judgements (qrels/test.qrels) and query.txt (the first
document). `more/` holds the next day's batch in the same layout: 3 further documents and their 12 images, for
`index.py --add`. Deterministic: the world is seeded, so a rerun rewrites the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's package

from cfir_jax.data.synthetic import SyntheticConfig, build_world  # noqa: E402

NUM_DOCUMENTS = 10
IMAGES_PER_DOCUMENT = 4
MORE_DOCUMENTS = 3  # the next day's batch (more/), added with index.py --add


def _pick(world, num_documents: int, per_document: int):
    """(documents, images of each document, {doc_id: {image_id: rel}}): test documents and, for each, its relevant
    images first, then other images of its planted entities, up to `per_document` new ones."""
    test = world.qrels["test"]
    by_id = {d.doc_id: d for d in world.documents}
    depicting: dict[str, list] = {}
    for img in world.images:
        for name in img.entities:
            depicting.setdefault(name, []).append(img)
    docs, images, qrels, taken = [], [], {}, set()
    for doc_id in sorted(test)[:num_documents]:
        doc = by_id[doc_id]
        relevant = [img for img in world.images if img.image_id in test[doc_id]]
        others = [img for name in doc.entities for img in depicting.get(name, [])]
        chosen = []
        for img in relevant + others:
            if len(chosen) == per_document:
                break
            if img.image_id not in taken:
                taken.add(img.image_id)
                chosen.append(img)
        docs.append(doc)
        images.append(chosen)
        qrels[doc_id] = {img.image_id: 1 for img in relevant}
    return docs, images, qrels


def make_collection(out: Path, size: str = "default", num_documents: int = NUM_DOCUMENTS,
                    per_document: int = IMAGES_PER_DOCUMENT, more: int = MORE_DOCUMENTS) -> None:
    """Writes the collection into `out` and the next day's batch into `out/more` (their generated files replaced;
    make.py itself kept)."""
    world = build_world(SyntheticConfig.named(size))
    docs, images, qrels = _pick(world, num_documents + more, per_document)
    for part, cut in ((out, slice(0, num_documents)), (out / "more", slice(num_documents, None))):
        if not docs[cut]:  # a world with no further test documents (the tests' tiny one, cut small) has no batch
            continue
        _write(part, docs[cut], [img for chosen in images[cut] for img in chosen],
               {d.doc_id: qrels[d.doc_id] for d in docs[cut]})


def _write(out: Path, docs, images, qrels) -> None:
    for name in ("images", "qrels"):
        shutil.rmtree(out / name, ignore_errors=True)
        (out / name).mkdir(parents=True)
    for img in images:
        (out / "images" / f"{img.image_id}.png").write_bytes(img.image)
    (out / "documents.jsonl").write_text("".join(
        json.dumps({"id": d.doc_id, "title": d.title, "text": d.text}) + "\n" for d in docs))
    (out / "images.jsonl").write_text("".join(
        json.dumps({"id": img.image_id, "path": f"images/{img.image_id}.png", "caption": img.caption,
                    "embedding": [round(float(x), 6) for x in img.embedding]}) + "\n" for img in images))
    (out / "qrels" / "test.qrels").write_text("".join(
        f"{d} 0 {i} {r}\n" for d in sorted(qrels) for i, r in sorted(qrels[d].items())))
    (out / "query.txt").write_text(docs[0].text + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="default", choices=("default", "tiny"), help="the world to cut from")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent), help="where to write")
    parser.add_argument("--documents", type=int, default=NUM_DOCUMENTS, help="documents before the next day's "
                        f"batch (default {NUM_DOCUMENTS})")
    args = parser.parse_args(argv)
    make_collection(Path(args.out), args.size, num_documents=args.documents)


if __name__ == "__main__":
    main()
