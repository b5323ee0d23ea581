"""The corpus under changes of the collection: `index.py --add PATH` appends the rows of PATH as a new part
(`stage_corpus_addition`), `--remove IDS.txt` lists ids as removed (`stage_corpus_removal`; rows stay). Each writes
one complete corpus (cfir_jax.data.corpus) into an empty staging directory; unchanged files are hard links of the old
ones, so a reader that has them memory-mapped keeps its view. Declared here (`cfir_jax.builders.descriptor`): the
corpus stage of index.py (`build_corpus`: converted by process 0 alone), extended by an add, masked by a removal,
untouched by a compaction."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.builders.descriptor import EXTEND, MASK, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.index_encoder import encoder_tokenizer
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import CfirError
from cfir_jax.data import synthetic
from cfir_jax.data.corpus import DOC_LANGS, FORMAT_VERSION, IMAGE_LANGS, KIND, Corpus, Image
from cfir_jax.data.corpus_languages import write_languages
from cfir_jax.data.corpus_writer import write_corpus_part, write_split_qrels
from cfir_jax.data.files import (
    ROW_FILE_SUFFIXES,
    build_files_corpus,
    image_files,
    read_documents,
    read_images,
    read_qrels,
    row_paths,
)
from cfir_jax.data.synthetic_languages import parse_shares
from cfir_jax.nlp.language_detect import LanguageDetector
from cfir_jax.stores.atomic_write import link_tree
from cfir_jax.stores.contract import manifest_digest, write_manifest
from cfir_jax.stores.integrity import CHECKSUMS, MANIFEST

REMOVED_IMAGES, REMOVED_DOCUMENTS = "removed_images.txt", "removed_documents.txt"
# Fields write_manifest sets itself.
_OWN_FIELDS = ("kind", "format_version", "created")


def _write_ids(path: Path, ids: Iterable[str]) -> None:
    path.write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")


def _fields(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in _OWN_FIELDS}


def _documents_sha(corpus: Corpus) -> str:
    # A corpus written before the digest existed: its manifest digest, which its documents_fingerprint stands on.
    return corpus.manifest.get("documents_sha") or manifest_digest(corpus.manifest)



@dataclasses.dataclass(frozen=True)
class Addition:
    """What `index.py --add PATH` names: a documents file, an images file or tree, a qrels directory (each or None);
    `image_files`: the images of the tree to read when not all of it (those beside a documents file)."""

    path: Path
    documents: Path | None = None
    images: Path | None = None
    qrels: Path | None = None
    image_files: tuple[Path, ...] | None = None


def _one_of(root: Path, stem: str) -> Path | None:
    found = [root / f"{stem}{s}" for s in ROW_FILE_SUFFIXES if (root / f"{stem}{s}").is_file()]
    if len(found) > 1:
        raise CfirError(f"{root}: both {found[0].name} and {found[1].name}; keep one {stem} file")
    return found[0] if found else None


def _named(paths: list[Path], root: Path) -> str:
    names = ", ".join(p.relative_to(root).as_posix() for p in paths[:3])
    return names + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def resolve_addition(path: str | os.PathLike) -> Addition:
    """The forms of --add PATH: (a) a directory with documents.jsonl|.parquet and/or images.jsonl|.parquet or an
    images/ tree, and optional qrels/ (with both, the rows file is read: its `path`s point into images/, as in
    examples/collection/); images beside a documents file, with no images file or folder, are read as a tree of
    image files; (b) a directory of image files only; (c) a .jsonl/.parquet file of image rows. One line when PATH
    is none of these, and when images sit where nothing would read them (beside images/, or named by no row of
    the images file)."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in ROW_FILE_SUFFIXES:
            raise CfirError(f"{path}: --add takes a directory or a .jsonl/.parquet file of image rows")
        return Addition(path, images=path)
    if not path.is_dir():
        raise CfirError(f"{path}: not found; --add takes a directory or a .jsonl/.parquet file of image rows")
    documents, images = _one_of(path, "documents"), _one_of(path, "images")
    qrels = path / "qrels" if (path / "qrels").is_dir() else None
    loose = [p for p in image_files(path) if p.relative_to(path).parts[0] not in ("images", "qrels")]
    if images is not None and loose:
        named = row_paths(images)
        loose = [p for p in loose if p.resolve() not in named]
        if loose:
            raise CfirError(f"{path}: no row of {images.name} names the images {_named(loose, path)}; add rows "
                            f"for them to {images.name}, or move them out of {path}")
    if images is None and (path / "images").is_dir():
        images = path / "images"
        if loose:
            raise CfirError(f"{path}: the images {_named(loose, path)} sit beside images/, which alone is read; "
                            "move them into images/")
    if images is None and loose:
        return Addition(path, documents, path, qrels, image_files=tuple(loose))
    if documents or images or qrels:
        return Addition(path, documents, images, qrels)
    raise CfirError(f"{path}: nothing to add; give documents.jsonl|.parquet, images.jsonl|.parquet, images/ or "
                    "image files")


def _peek(items: Iterable[Image]) -> tuple[Image | None, Iterator[Image]]:
    it = iter(items)
    first = next(it, None)
    return first, (itertools.chain([first], it) if first is not None else it)


def _check_embeddings(corpus: Corpus, where: Path, first: Image | None) -> None:
    """One line when the added images carry precomputed embeddings and the corpus' do not, or the other way round,
    or of another dim."""
    if first is None:
        return
    have = None if first.embedding is None else int(np.asarray(first.embedding).shape[-1])
    if have == corpus.embedding_dim:
        return
    if have is None:
        raise CfirError(f"{where}: the added images have no 'embedding' but the collection's images carry "
                        f"precomputed embeddings of dim {corpus.embedding_dim}; give every row one")
    if corpus.embedding_dim is None:
        raise CfirError(f"{where}: the added images carry precomputed embeddings but the collection's have none; "
                        "leave the 'embedding' field out")
    raise CfirError(f"{where}: the added embeddings have dim {have} but the collection's have "
                    f"{corpus.embedding_dim}")


def _union_qrels(corpus: Corpus, added: dict, out_dir: Path, doc_ids: Sequence[str], image_ids: Sequence[str],
                 addition: Addition) -> tuple[dict, int]:
    """Writes qrels/<split>.txt of the union (the old judgements, then the added ones); returns (splits, added)."""
    (out_dir / "qrels").mkdir()
    docs, images = set(doc_ids), set(image_ids)
    splits, num_added = {}, 0
    for split in sorted(set(corpus.splits) | set(added), key=("train", "validation", "test").index):
        qrels = corpus.qrels(split) if split in corpus.splits else {}
        for doc_id, judged in added.get(split, {}).items():
            qrels.setdefault(doc_id, {}).update(judged)
            num_added += len(judged)
        label = f"{addition.qrels}: {split} qrels" if split in added else f"{corpus.path}/qrels/{split}.txt"
        topics, judgements, _ = write_split_qrels(out_dir / "qrels" / f"{split}.txt", split, qrels, docs, images,
                                                  False, label)
        old = corpus.manifest["splits"].get(split, {}) if isinstance(corpus.manifest["splits"], dict) else {}
        splits[split] = {"topics": topics, "judgements": judgements, "dropped": int(old.get("dropped", 0))}
    return splits, num_added


def stage_corpus_addition(corpus: Corpus, out_dir: str | os.PathLike, addition: str | os.PathLike,
                          detect: LanguageDetector | None = None) -> dict:
    """The corpus with the rows of `addition` (an --add PATH, `resolve_addition`) appended as a new part, staged in
    `out_dir`, the languages of its texts found by `detect` where not stated. Ids already in the collection are
    refused in one line naming file:line. Returns the counts: documents_added, images_added, judgements_added,
    first_new_document, first_new_image (the union rows where the added ones start) and part."""
    out_dir, add = Path(out_dir), resolve_addition(addition)
    documents = read_documents(add.documents, existing=set(corpus.doc_ids)) if add.documents else iter(())
    files = list(add.image_files) if add.image_files else None
    known = corpus.manifest.get("image_fields") or {}
    first_image, images = _peek(read_images(add.images, existing=set(corpus.image_ids), files=files,
                                            known_fields=known) if add.images else ())
    _check_embeddings(corpus, add.images or add.path, first_image)
    parts = list(corpus.manifest.get("parts") or [])
    name = f"parts/{len(parts) + 1:04d}"
    link_tree(corpus.path, out_dir, skip=(MANIFEST, CHECKSUMS, "doc_ids.txt", "image_ids.txt", "qrels", DOC_LANGS,
                                          IMAGE_LANGS))
    part, written = write_corpus_part(out_dir / name, documents, images, corpus.embedding_dim, source=add.path,
                                      detect=detect, among=corpus.languages,
                                      known_fields=known)
    new_docs, new_images = written.doc_ids, written.image_ids
    doc_ids, image_ids = corpus.doc_ids + new_docs, corpus.image_ids + new_images
    languages = {}
    if corpus.doc_langs or any(x not in ("en", "") for x in (*written.doc_langs, *written.image_langs)):
        languages = write_languages(out_dir, _langs(corpus, "documents") + written.doc_langs,
                                    _langs(corpus, "images") + written.image_langs, detect)
    _write_ids(out_dir / "doc_ids.txt", doc_ids)
    _write_ids(out_dir / "image_ids.txt", image_ids)
    splits, judgements = _union_qrels(corpus, read_qrels(add.qrels) if add.qrels else {}, out_dir, doc_ids,
                                      image_ids, add)
    # Chained: the old digest cannot be continued (module docstring of cfir_jax.data.corpus). Images alone keep it.
    sha = _documents_sha(corpus)
    if new_docs:
        sha = hashlib.sha256(f"{sha}\n{part['documents_sha']}".encode()).hexdigest()[:16]
    parts.append({"path": name, "num_documents": len(new_docs), "num_images": len(new_images)})
    fields = {k: v for k, v in _fields(corpus.manifest).items() if k != "languages"}
    write_manifest(out_dir, KIND, FORMAT_VERSION, **{
        **fields, "num_documents": len(doc_ids), "num_images": len(image_ids),
        "documents_sha": sha, "splits": splits, "parts": parts,
        "images_with_text": int(corpus.manifest.get("images_with_text") or 0) + part["images_with_text"], **languages,
        **({"image_fields": part["image_fields"]} if part.get("image_fields") else {})})
    return {"documents_added": len(new_docs), "images_added": len(new_images), "judgements_added": judgements,
            "first_new_document": corpus.num_documents, "first_new_image": corpus.num_images, "part": name}


def _langs(corpus: Corpus, what: str) -> list[str]:
    """The languages of a corpus' documents or images, English where it recorded none (each image read once then:
    '' for one without text), when an addition brings the first text in another language."""
    if what == "documents":
        return list(corpus.doc_langs) or ["en"] * corpus.num_documents
    return list(corpus.image_langs) or [corpus.image(i).lang for i in range(corpus.num_images)]


def resolve_removals(corpus: Corpus, ids_file: str | os.PathLike) -> tuple[list[str], list[str], list[str]]:
    """(image ids, document ids, ids already removed) an IDS.txt names: one id a line, `image:ID` / `document:ID`
    where an id is both; blank lines skipped, repeats counted once. An unknown id, or an id of both kinds without a
    prefix, is one line naming file:line. Already-removed ids come back in the third list (skipped, not errors)."""
    ids_file = Path(ids_file)
    try:
        lines = ids_file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CfirError(f"{ids_file}: not found; --remove takes a file of ids, one a line") from None
    except UnicodeDecodeError:
        raise CfirError(f"{ids_file}: not UTF-8 text; --remove takes a file of ids, one a line") from None
    known = {"image": set(corpus.image_ids), "document": set(corpus.doc_ids)}
    removed = {"image": corpus.removed_image_ids, "document": corpus.removed_doc_ids}
    out: dict[str, dict[str, None]] = {"image": {}, "document": {}}  # ordered sets
    already: dict[str, None] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        if line not in known["image"] and line not in known["document"]:
            line = unicodedata.normalize("NFC", line)  # ids are NFC (cfir_jax.data.files)
        kind, ident = _kind_of(line, known, f"{ids_file}:{n}")
        if ident in removed[kind]:
            already[ident] = None
        else:
            out[kind][ident] = None
    return list(out["image"]), list(out["document"]), list(already)


def _kind_of(line: str, known: dict[str, set[str]], where: str) -> tuple[str, str]:
    """(kind, id) of one IDS.txt line."""
    for kind in ("image", "document"):
        prefix = f"{kind}:"
        if line.startswith(prefix) and line not in known["image"] and line not in known["document"]:
            ident = line[len(prefix):]
            if ident not in known[kind]:
                article = "an" if kind == "image" else "a"
                raise CfirError(f"{where}: {ident!r} is not {article} {kind} id of the collection")
            return kind, ident
    kinds = [k for k in ("image", "document") if line in known[k]]
    if not kinds:
        raise CfirError(f"{where}: {line!r} is neither an image nor a document id of the collection")
    if len(kinds) == 2:
        raise CfirError(f"{where}: {line!r} is both an image and a document id; write image:{line} or "
                        f"document:{line}")
    return kinds[0], line


def stage_corpus_removal(corpus: Corpus, out_dir: str | os.PathLike, image_ids: Iterable[str],
                         doc_ids: Iterable[str]) -> dict:
    """The corpus with `image_ids` and `doc_ids` added to its removed lists (rows stay), staged in `out_dir`.
    Returns {images_removed, documents_removed} (newly removed), and the totals removed_images, removed_documents."""
    out_dir = Path(out_dir)
    images, docs = set(image_ids), set(doc_ids)
    unknown = sorted((images - set(corpus.image_ids)) | (docs - set(corpus.doc_ids)))
    if unknown:
        raise CfirError(f"{corpus.path}: ids {unknown[:3]} are not in the corpus; resolve them with resolve_removals")
    link_tree(corpus.path, out_dir, skip=(MANIFEST, CHECKSUMS, REMOVED_IMAGES, REMOVED_DOCUMENTS))
    all_images = [i for i in corpus.image_ids if i in images or i in corpus.removed_image_ids]
    all_docs = [d for d in corpus.doc_ids if d in docs or d in corpus.removed_doc_ids]
    _write_ids(out_dir / REMOVED_IMAGES, all_images)
    _write_ids(out_dir / REMOVED_DOCUMENTS, all_docs)
    # documents_sha pinned: the corpus' documents fingerprint (entities, summaries) does not change on a removal.
    write_manifest(out_dir, KIND, FORMAT_VERSION, **{
        **_fields(corpus.manifest), "documents_sha": _documents_sha(corpus), "removed_images": len(all_images),
        "removed_documents": len(all_docs)})
    return {"images_removed": len(all_images) - len(corpus.removed_image_ids),
            "documents_removed": len(all_docs) - len(corpus.removed_doc_ids),
            "removed_images": len(all_images), "removed_documents": len(all_docs)}



def documents_added(change: ChangeRun) -> int:
    """How many documents the change's staged corpus added (0 before it is staged, and for other changes)."""
    return change.new("corpus").num_documents - change.old("corpus").num_documents


def write_corpus(config, layout) -> None:
    """The corpus stage (process 0 alone: a format conversion, not model work; splitting it over hosts would buy
    little): AToMiC parquet files, a synthetic world, or plain files, as index.corpus.source says."""
    c, detect = config.index.corpus, LanguageDetector.of(config)
    if c.source == "synthetic":
        languages = parse_shares(c.get("synthetic_languages", ""))
        synthetic.generate(layout.corpus, synthetic.SyntheticConfig.named(c.synthetic_size, c.seed, languages), detect)
        return
    if c.source == "atomic":
        # why: pyarrow loads for an AToMiC build only
        from cfir_jax.data.atomic import build_atomic_corpus

        if not (c.texts and c.images and c.qrels):
            if layout.corpus.is_dir():
                return
            raise CfirError("AToMiC corpus: set --config.index.corpus.texts=..., .images=..., .qrels=... (local "
                            "copies of TREC-AToMiC/AToMiC-Texts-v0.2.1, AToMiC-Images-v0.2, AToMiC-Qrels-v0.2)")
        split = lambda s: [p for p in s.split(",") if p] if "," in s else s  # noqa: E731
        splits = tuple(p.strip() for p in c.splits.split(",") if p.strip())
        build_atomic_corpus(split(c.texts), split(c.images), c.qrels, layout.corpus, setting=c.setting,
                            splits=splits, detect=detect)
    elif c.source == "files":
        build_files_corpus(c.documents, c.images, c.qrels or None, layout.corpus,
                           tokenizer_spm=encoder_tokenizer(config), detect=detect)
    else:
        raise CfirError(f"index.corpus.source={c.source!r}: use 'atomic', 'synthetic' or 'files'")


def _added(change: ChangeRun, out: Path) -> dict:
    info = stage_corpus_addition(change.old("corpus"), out, change.payload.path, LanguageDetector.of(change.config))
    return {k: info[k] for k in ("documents_added", "images_added", "judgements_added")}


def _removed(change: ChangeRun, out: Path) -> dict:
    info = stage_corpus_removal(change.old("corpus"), out, change.payload.images, change.payload.documents)
    return {k: info[k] for k in ("images_removed", "documents_removed", "removed_images")}


def corpus_summary(corpus: Corpus) -> str:
    """The stage's line of index.py's closing table: with the documents and captions per language, when not all
    English."""
    langs = corpus.manifest.get("languages") or {}
    counts = lambda of: ", ".join(f"{c} {n:,}" for c, n in of.items())  # noqa: E731
    return f"{corpus.num_documents:,} documents, {corpus.num_images:,} images" + (
        f"; documents {counts(langs['documents'])}; captions {counts(langs['images'])}" if langs else "")


def _open_corpus(run: StageRun) -> Corpus:
    return Corpus.open(run.layout.corpus)


declare(Stage(
    "corpus", reader=Corpus.open,
    build=Build(lambda run: write_corpus(run.config, run.layout), corpus_summary, every_host=False,
                open=_open_corpus, unselected=_open_corpus),
    changes=Changes(add=Step(EXTEND, _added), remove=Step(MASK, _removed))))
