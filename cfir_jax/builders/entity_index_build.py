"""Builds the entity candidate index (the store `cfir_jax.stores.entity_index` reads; its layout is described there).

A build works in chunks of entities inside a sibling work directory (`.<name>.building`), one file per finished
chunk (marked done after its rows are on disk), so an interrupted build resumes where it stopped, and the processes
of a multi-host build each search their own chunks; the finished files are then moved into place atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.builders.candidate_search import BACKENDS, CandidateSearcher, measure_recall, shared_searcher
from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.search.knn import ScannConfig
from cfir_jax.stores.atomic_write import save_npy_atomic, work_dir, write_json_atomic
from cfir_jax.stores.contract import atomic_dir, read_manifest, write_manifest
from cfir_jax.stores.entities import entity_key
from cfir_jax.stores.entity_index import KIND, VERSION

log = logging.getLogger(__name__)


def check_inputs(texts: Sequence[str], embeddings: np.ndarray | None, images: np.ndarray) -> None:
    """Shapes and unique texts; `embeddings` None: they are computed later, chunk by chunk (an encode function)."""
    if embeddings is not None and (embeddings.ndim != 2 or embeddings.shape[0] != len(texts)):
        raise CfirError(
            f"entity_embeddings has shape {embeddings.shape} but there are {len(texts)} entity texts; "
            "pass one [D] row per text"
        )
    if images.ndim != 2 or images.shape[0] == 0:
        raise CfirError(f"image_embeddings must be a non-empty [N, D] matrix, got shape {images.shape}")
    if embeddings is not None and embeddings.shape[1] != images.shape[1]:
        raise CfirError(
            f"entity dim {embeddings.shape[1]} != image dim {images.shape[1]}; encode both with the same model"
        )
    seen: set[str] = set()
    for t in texts:
        if entity_key(t) in seen:
            raise CfirError(f"duplicate entity text {t!r} (case-insensitively); de-duplicate the entity list first")
        seen.add(entity_key(t))


def _fingerprint_inputs(texts: Sequence[str], embeddings: np.ndarray | None, **params) -> str:
    """A digest of what a build depends on, so a resume with other inputs starts over instead of mixing them (an
    encode function's embeddings are named by the model fingerprint among `params`)."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    if embeddings is not None:
        h.update(np.ascontiguousarray(embeddings[:: max(1, len(texts) // 1024)], dtype=np.float32).tobytes())
    return h.hexdigest()


def write_csr(
    out: Path,
    blocks: Sequence[tuple[np.ndarray, np.ndarray | None]],
    keep_scores: bool,
) -> int:
    """Writes offsets/candidates/scores.npy into `out` from padded blocks; returns the number of candidates M.

    blocks: (candidates [r, K] int32 padded with -1, scores [r, K] or None) in entity order (memmap slices are read
    one block at a time). Two passes over the blocks (the lengths, then the copy) so the flat arrays are written
    once, straight into memory-mapped files.
    """
    lengths = [np.count_nonzero(np.asarray(c) >= 0, axis=1) for c, _ in blocks]
    new = np.cumsum(np.concatenate(lengths), dtype=np.int64) if lengths else np.zeros(0, np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64), new])
    m = int(offsets[-1])
    np.save(out / "offsets.npy", offsets)
    cand = np.lib.format.open_memmap(out / "candidates.npy", mode="w+", dtype=np.int32, shape=(m,))
    scores = np.lib.format.open_memmap(out / "scores.npy", mode="w+", dtype=np.float16, shape=(m,)) \
        if keep_scores else None
    pos = 0
    for c, sc in blocks:
        c = np.asarray(c)
        valid = c >= 0
        flat = c[valid]
        cand[pos : pos + len(flat)] = flat
        if scores is not None:
            scores[pos : pos + len(flat)] = np.asarray(sc)[valid]
        pos += len(flat)
    cand.flush()
    if scores is not None:
        scores.flush()
    del cand, scores
    return m


def _chunk_files(work: Path, c: int) -> tuple[Path, Path, Path]:
    """chunk c's padded candidates [r, K] int32 and scores [r, K] float16, and its marker (written last)."""
    name = f"chunk-{c:06d}"
    return work / f"{name}.candidates.npy", work / f"{name}.scores.npy", work / f"{name}.done"


def _embedding_file(work: Path, c: int) -> Path:
    """chunk c's entity embeddings [r, D] float32 (kept in the store: an update scores them without the encoder)."""
    return work / f"chunk-{c:06d}.embeddings.npy"


def write_embeddings(out: Path, blocks: Sequence[np.ndarray], dim: int) -> None:
    """Writes entity_embeddings.npy float32 [E, D] into `out` from row blocks (memmaps read one at a time)."""
    e = sum(len(b) for b in blocks)
    emb = np.lib.format.open_memmap(out / "entity_embeddings.npy", mode="w+", dtype=np.float32, shape=(e, dim))
    pos = 0
    for b in blocks:
        emb[pos : pos + len(b)] = np.asarray(b, np.float32)
        pos += len(b)
    emb.flush()
    del emb


def _fill_chunks(
    work: Path,
    n: int,
    embed: Callable[[int, int], np.ndarray],
    search: CandidateSearcher,
    keep_scores: bool,
    chunk_size: int,
    on_chunk: Callable[[int], None] | None,
    progress: bool,
) -> None:
    """Searches this process's chunks of the `n` entities (`hosts.owns`) into work/, skipping finished ones (another
    process's, from an earlier run with another process count, included). embed(a, b) -> [b - a, D] float32."""
    n_chunks = -(-n // chunk_size)
    mine = [c for c in range(n_chunks) if hosts.owns(c)]
    for c in progress_bar(mine, desc="entity index", show=progress):
        cand_path, score_path, done_path = _chunk_files(work, c)
        if done_path.is_file():
            continue
        a, b = c * chunk_size, min(n, (c + 1) * chunk_size)
        emb = np.asarray(embed(a, b), np.float32)
        s, i = search(emb)
        save_npy_atomic(_embedding_file(work, c), emb)
        save_npy_atomic(cand_path, np.asarray(i, np.int32))
        if keep_scores:
            save_npy_atomic(score_path, np.asarray(s, np.float16))
        # Marked only after the rows are on disk: a crash before this line redoes the chunk, never skips it.
        done_path.touch()
        if on_chunk is not None:
            on_chunk(c)


def _read_chunks(work: Path, n: int, chunk_size: int, rows: np.ndarray | None = None, scores: bool = False):
    """The padded [n, K] candidates (or scores) of every chunk, as one block per chunk; `rows`: only those rows."""
    blocks = []
    for c in range(-(-n // chunk_size)):
        cand_path, score_path, done_path = _chunk_files(work, c)
        if not done_path.is_file():
            raise StoreError(f"{work}: chunk {c} is missing after every process finished; run index.py again")
        blocks.append(np.load(score_path if scores else cand_path, mmap_mode="r"))
    if rows is None:
        return blocks
    return np.stack([blocks[r // chunk_size][r % chunk_size] for r in rows])  # a few rows, never all [n, K]


def _checked_k(k: int, n: int, backend: str) -> tuple[int, int]:
    """(K clamped to the `n` images, K as requested); a bad K or backend is a one-line error."""
    k_requested = int(k)
    k = min(k_requested, n)
    if k < 1:
        raise CfirError(f"k={k_requested} must be >= 1")
    if k < k_requested:
        log.warning("entity index: K=%d > %d images; clamped to K=%d", k_requested, n, k)
    if backend not in BACKENDS:
        raise CfirError(f"backend={backend!r}: choose one of {BACKENDS}")
    return k, k_requested


def _open_work_dir(work: Path, digest: str) -> None:
    """Process 0 keeps `work` for a resume of the same inputs (`digest`) or starts it over; all processes wait."""
    params_path = work / "build.json"
    if hosts.is_main():
        if work.exists() and not (params_path.is_file() and
                                  json.loads(params_path.read_text()).get("digest") == digest):
            shutil.rmtree(work)  # A partial build of other inputs: starting over is the only safe choice.
        work.mkdir(parents=True, exist_ok=True)
        write_json_atomic(params_path, {"digest": digest})
    hosts.barrier("entity_index_work_dir")


def _row_embedder(
    entity_texts: Sequence[str],
    entity_embeddings: np.ndarray | Callable[[Sequence[str]], np.ndarray],
    dim: int,
) -> Callable[[int, int], np.ndarray]:
    """embed(a, b) -> rows a..b of the given [E, D] matrix, or the encoder's rows for texts a..b (shape checked)."""
    if not callable(entity_embeddings):
        return lambda a, b: entity_embeddings[a:b]

    def embed_rows(a: int, b: int) -> np.ndarray:
        rows = np.asarray(entity_embeddings(entity_texts[a:b]))
        if rows.shape != (b - a, dim):
            raise CfirError(f"the entity encoder gave {rows.shape} for {b - a} texts but the images are {dim}-d; "
                            "encode both with the same model")
        return rows

    return embed_rows


def _sample_recall(
    search: CandidateSearcher,
    entity_texts: Sequence[str],
    entity_embeddings: np.ndarray | Callable[[Sequence[str]], np.ndarray],
    work: Path,
    chunk_size: int,
    recall_sample: int,
) -> float | None:
    """The recall@K of the candidates in `work` against exact search on `recall_sample` entities."""
    e = len(entity_texts)
    sample = (lambda rows: entity_embeddings([entity_texts[r] for r in rows])) if callable(entity_embeddings) else \
        (lambda rows: entity_embeddings[rows])
    return measure_recall(search, sample, e, lambda rows: _read_chunks(work, e, chunk_size, rows), recall_sample)


def _commit(
    out_dir: Path,
    work: Path,
    entity_texts: Sequence[str],
    search: CandidateSearcher,
    recall: float | None,
    fields: dict,
    *,
    backend: str,
    chunk_size: int,
    keep_scores: bool,
    keep_searcher: bool,
    recall_sample: int,
    sources: dict | None,
) -> None:
    """Writes the store from the finished chunks of `work` into out_dir atomically, then removes `work`.

    fields: the manifest fields the build settled before the search (fingerprint, dim, K, image count)."""
    e = len(entity_texts)
    with atomic_dir(out_dir) as tmp:
        blocks = list(zip(_read_chunks(work, e, chunk_size),
                          _read_chunks(work, e, chunk_size, scores=True) if keep_scores else
                          [None] * -(-e // chunk_size)))
        n_candidates = write_csr(tmp, blocks, keep_scores)
        del blocks
        write_embeddings(tmp, [np.load(_embedding_file(work, c), mmap_mode="r") for c in range(-(-e // chunk_size))],
                         fields["dim"])
        if keep_searcher and backend == "scann":
            os.replace(work / "scann", tmp / "scann")
        (tmp / "vocab.json").write_text(json.dumps(list(entity_texts), ensure_ascii=False), encoding="utf-8")
        write_manifest(
            tmp, KIND, VERSION, **fields, backend=backend, n_entities=e, n_candidates=n_candidates, recall_at_k=recall,
            recall_sample=min(recall_sample, e) if backend == "scann" else 0,
            scann_config=dataclasses.asdict(search.scann.config) if search.scann else None,
            has_scores=keep_scores, has_searcher=keep_searcher and backend == "scann", has_embeddings=True,
            searcher_rows=fields["n_images"] if keep_searcher and backend == "scann" else 0,
            n_live=fields["n_images"], chunk_size=chunk_size, **(sources or {}),
        )
    shutil.rmtree(work)


@dataclasses.dataclass(frozen=True)
class EntityIndexSettings:
    """How an entity index is built (index.entity_index's keys, resolved): each entity's `k` best images, by the
    `backend` ("exact" or "scann", with `scann_config`); whether the store keeps the candidates' scores and the ScaNN
    tree; how many entities measure recall@K; entities per chunk (the unit of resumption and of a host's share); and
    whether a progress bar is shown."""

    k: int
    backend: str = "scann"
    scann_config: ScannConfig | None = None
    keep_scores: bool = True
    keep_searcher: bool = True
    recall_sample: int = 256
    chunk_size: int = 4096
    progress: bool = False


def build_entity_index(
    out_dir: str | os.PathLike,
    entity_texts: Sequence[str],
    entity_embeddings: np.ndarray | Callable[[Sequence[str]], np.ndarray],
    image_embeddings: np.ndarray,
    settings: EntityIndexSettings,
    *,
    model_fingerprint: str,
    on_chunk: Callable[[int], None] | None = None,
    sources: dict | None = None,
) -> float | None:
    """Builds the entity index into out_dir; resumes an interrupted build of the same inputs.

    entity_texts [E] unique; entity_embeddings [E, D] f32, or a function texts [r] -> [r, D] f32 (the frozen text
    tower: then each chunk's texts are encoded where the chunk is searched); image_embeddings [N, D] f16/f32 (memmap
    fine). `settings` says how (its k > N is clamped to N).

    Across the processes of a jax.distributed run (`hosts`), chunk c of `chunk_size` entities is encoded and
    searched by process c % P against the whole cache; process 0 builds the ScaNN searcher once (every process loads
    it), measures recall and writes the store from all chunks; every process returns after the commit.

    on_chunk(i) is called after chunk i is on disk (progress hooks, tests). `sources` (JSON-able: fingerprints of
    what the texts and images were derived from) go into the manifest.
    Returns the recall@K of the stored candidates against exact search on `recall_sample` entities (1.0 for
    backend="exact"; None if not measured).
    """
    k, backend, scann_config, keep_scores, keep_searcher, recall_sample, chunk_size, progress = (
        settings.k, settings.backend, settings.scann_config, settings.keep_scores, settings.keep_searcher,
        settings.recall_sample, settings.chunk_size, settings.progress)
    out_dir = Path(out_dir)
    embeddings = None if callable(entity_embeddings) else entity_embeddings
    check_inputs(entity_texts, embeddings, image_embeddings)
    n, dim = image_embeddings.shape
    k, k_requested = _checked_k(k, n, backend)
    work = work_dir(out_dir)
    _open_work_dir(work, _fingerprint_inputs(
        entity_texts, embeddings, k=k, n=n, dim=dim, backend=backend, fp=model_fingerprint,
        scann=dataclasses.asdict(scann_config) if scann_config else None, scores=keep_scores, chunk=chunk_size,
        layout="chunk-files-2",  # chunk files with their embeddings: a resumed older build starts over
    ))

    search = shared_searcher(backend, image_embeddings, k, scann_config, work / "scann")
    embed_rows = _row_embedder(entity_texts, entity_embeddings, dim)
    _fill_chunks(work, len(entity_texts), embed_rows, search, keep_scores, chunk_size, on_chunk, progress)
    hosts.barrier("entity_index_chunks")

    if hosts.is_main():
        recall = _sample_recall(search, entity_texts, entity_embeddings, work, chunk_size, recall_sample)
        _commit(out_dir, work, entity_texts, search, recall,
                dict(model_fingerprint=model_fingerprint, dim=dim, k=k, k_requested=k_requested, n_images=n),
                backend=backend, chunk_size=chunk_size, keep_scores=keep_scores, keep_searcher=keep_searcher,
                recall_sample=recall_sample, sources=sources)
    hosts.barrier("entity_index_committed")
    return read_manifest(out_dir, KIND, VERSION)["recall_at_k"]


def indexed_entities(config, corpus, entities) -> list[str]:
    """The entity texts the index is built from: those of the documents `index.entity_index.documents` names.

    'train' (the paper's protocol): the topics of the train qrels, so a test document's entities that no training
    document mentions are unknown at query time, and the test split does not leak into the index. 'all': every
    document of the corpus. Texts come in entity-store order (first mention), so the choice only filters. Documents
    removed by `index.py --remove` count for neither: an entity only they name is left out.
    """
    documents = config.index.entity_index.documents
    removed = corpus.removed_doc_ids
    if documents == "all" and not removed:
        return list(entities.vocab)
    if documents not in ("all", "train"):
        raise CfirError(f"index.entity_index.documents={documents!r}: use 'train' (the paper) or 'all'")
    if documents == "train" and "train" not in corpus.splits:
        raise CfirError(f"{corpus.path}: no train qrels to take the indexed entities from; set "
                        "--config.index.entity_index.documents=all")
    topics = corpus.qrels("train") if documents == "train" else None
    ids = [entities.entity_ids_of(i) for i, d in enumerate(entities.doc_ids)
           if d not in removed and (topics is None or d in topics)]
    keep = np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
    if not len(keep):
        raise CfirError(f"{corpus.path}: the {documents} documents (removed ones left out) have no entities; set "
                        "--config.index.entity_index.documents=all")
    return [entities.vocab[i] for i in keep]


def texts_digest(texts: list[str]) -> str:
    """What the entity index records of the entity texts it was built from (`entities_sha`): a change of the
    collection records the same of the texts it leaves indexed."""
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
