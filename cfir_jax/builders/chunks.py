"""The chunked multi-host builds of the index stages: a work directory every process shares (`shared_work_dir`), and
resumable chunks of documents owned round-robin by the processes (`iter_chunks`), which process 0 alone assembles and
commits into one store (`commit_on_main`). Used by the builders (`builders/`) only: readers open finished stores
(`cfir_jax.stores`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from cfir_jax.core import hosts, progress
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.stores.atomic_write import atomic_file, partial_dir, work_dir, write_json_atomic
from cfir_jax.stores.contract import read_manifest

log = logging.getLogger(__name__)


def shared_work_dir(out_dir: str | Path, key: dict) -> Path:
    """The work directory `.<name>.building` beside `out_dir` where every process of a build writes its finished
    shards, kept from an interrupted build of the same `key` and otherwise started over. Process 0 alone decides,
    before the others look (a barrier), so no process deletes shards another is writing."""
    out_dir = Path(out_dir)
    work = work_dir(out_dir)
    if hosts.is_main():
        key_path = work / "build.json"
        try:
            same = json.loads(key_path.read_text()) == key
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            write_json_atomic(key_path, key)
    hosts.barrier(f"work_dir:{out_dir.name}")
    return work


def _settings_fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def iter_chunks(
    out_dir: str | Path,
    docs: Iterable[tuple[str, str]],
    process: Callable[[list[str]], list[Any]],
    settings: dict[str, Any],
    chunk_size: int,
    num_docs: int | None = None,
    desc: str = "documents",
) -> Iterator[tuple[list[str], list[Any]]]:
    """Yields (doc_ids, results) per chunk of `chunk_size` documents, computing each chunk at most once.

    `process` maps a chunk's texts to one JSON-serialisable result per text. Each finished chunk is saved in
    `partial_dir(out_dir)`; a restarted build with the same `settings` (and chunk size) reads it back instead of
    recomputing, after checking that the input still has the same document ids there. Different settings discard
    the old chunks (decided by process 0 alone, before the others look). The caller removes the partial directory
    once its store is complete (`finish_chunks`).

    Across the processes of a jax.distributed run (`hosts`), chunk i is computed by process i % P (a chunk on disk
    is reused whoever wrote it, so a rerun with another process count resumes too); every process reads the whole
    `docs` stream (cheap next to NER or BART) and computes only its own chunks. Then, once all processes are done,
    process 0 yields every chunk in order and the others yield nothing: the caller assembles and commits the store
    on process 0 (`commit_on_main`). With one process the same code computes, then yields, every chunk.
    """
    if chunk_size < 1:
        raise CfirError(f"chunk_size={chunk_size} must be >= 1")
    partial = partial_dir(out_dir)
    build_info = {"settings": settings, "chunk_size": chunk_size}
    fingerprint = _settings_fingerprint(build_info)
    info_path = partial / "build.json"
    if hosts.is_main():
        if partial.exists():
            try:
                old = json.loads(info_path.read_text()).get("fingerprint")
            except (OSError, ValueError):
                old = None
            if old != fingerprint:
                log.info("%s: settings changed since the interrupted build; starting over", partial)
                shutil.rmtree(partial)
        partial.mkdir(parents=True, exist_ok=True)
        write_json_atomic(info_path, {"fingerprint": fingerprint, **build_info})
    hosts.barrier(f"chunks_reset:{partial.name}")

    digests = _compute_chunks(partial, docs, process, chunk_size, num_docs, desc)
    hosts.barrier(f"chunks_done:{partial.name}")
    if not hosts.is_main():
        return
    for index, digest in enumerate(digests):
        path = _chunk_path(partial, index)
        saved = _read_chunk(path)
        if saved is None:
            raise StoreError(f"{path}: missing after every process finished its chunks; run index.py again")
        if _ids_digest(saved["doc_ids"]) != digest:
            raise CfirError(f"{path}: the documents differ from those of the interrupted build; delete {partial} "
                            "to start over")
        yield saved["doc_ids"], saved["results"]


def _chunk_path(partial: Path, index: int) -> Path:
    return partial / f"chunk-{index:06d}.json"


def _ids_digest(doc_ids: list[str]) -> str:
    return hashlib.sha256("\n".join(doc_ids).encode()).hexdigest()


def _owned_docs(num_docs: int | None, chunk_size: int) -> int | None:
    """How many of `num_docs` documents fall in this process's chunks (the length of its progress bar)."""
    if num_docs is None:
        return None
    chunks = -(-num_docs // chunk_size)
    return sum(min(chunk_size, num_docs - i * chunk_size) for i in range(chunks) if hosts.owns(i))


def _compute_chunks(
    partial: Path,
    docs: Iterable[tuple[str, str]],
    process: Callable[[list[str]], list[Any]],
    chunk_size: int,
    num_docs: int | None,
    desc: str,
) -> list[str]:
    """Computes this process's missing chunks into `partial`; returns the doc-id digest of every chunk of `docs`."""
    docs_iter = iter(docs)
    digests: list[str] = []
    with progress.bar(total=_owned_docs(num_docs, chunk_size), desc=desc, unit="doc") as bar:
        for index in itertools.count():
            chunk = list(itertools.islice(docs_iter, chunk_size))
            if not chunk:
                return digests
            for position, item in enumerate(chunk):
                if not (
                    isinstance(item, (tuple, list))
                    and len(item) == 2
                    and isinstance(item[0], str)
                    and isinstance(item[1], str)
                ):
                    raise CfirError(
                        f"document #{index * chunk_size + position}: expected a (doc_id: str, text: str) pair, "
                        f"got {str(item)[:80]!r}; fix the corpus reader"
                    )
            doc_ids = [doc_id for doc_id, _ in chunk]
            digests.append(_ids_digest(doc_ids))
            if not hosts.owns(index):
                continue
            path = _chunk_path(partial, index)
            saved = _read_chunk(path)
            if saved is not None:
                if saved["doc_ids"] != doc_ids:
                    raise CfirError(
                        f"{path}: the documents differ from those of the interrupted build; "
                        f"delete {partial} to start over"
                    )
                bar.update(len(chunk))
                continue
            results = []
            for result in process([text for _, text in chunk]):
                results.append(result)
                bar.update(1)  # per document, so a chunk of thousands shows its rate and ETA as it goes
            if len(results) != len(chunk):  # A broken `process` must not misalign ids and results.
                raise RuntimeError(f"process returned {len(results)} results for {len(chunk)} texts")
            write_json_atomic(path, {"doc_ids": doc_ids, "results": results})
    return digests


def _read_chunk(path: Path) -> dict | None:
    """A finished chunk, or None when absent or unreadable (then it is recomputed)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        log.warning("%s: unreadable chunk; recomputing it", path)
        return None
    if not isinstance(saved, dict) or not {"doc_ids", "results"} <= saved.keys():
        return None
    return saved


def finish_chunks(out_dir: str | Path) -> None:
    """Removes the chunks of a build whose store is now complete."""
    shutil.rmtree(partial_dir(out_dir), ignore_errors=True)


def commit_on_main(out_dir: str | Path, kind: str, chunks: Iterator[Any], assemble: Callable[[Iterator[Any]], Any],
                   work: str | Path | None = None) -> dict:
    """Runs `assemble(chunks)` (which writes the store at `out_dir`) on process 0, then removes the chunks (those
    `iter_chunks` kept for `work`, by default `out_dir`); the other processes run `chunks` to its end (computing their
    own, see `iter_chunks`). Every process returns the committed store's manifest, read after a barrier."""
    if hosts.is_main():
        assemble(chunks)
        finish_chunks(work if work is not None else out_dir)
    else:
        for _ in chunks:
            raise RuntimeError("iter_chunks yielded a chunk on a process other than 0")
    hosts.barrier(f"committed:{Path(out_dir).name}")
    return read_manifest(out_dir, kind)


def check_doc_id(doc_id: str, seen: set[str], where: str) -> None:
    """Refuses ids a line-per-id file cannot hold, and repeated ids (they would make doc -> row ambiguous)."""
    if not doc_id or "\n" in doc_id or "\r" in doc_id:
        raise CfirError(f"{where}: document id {doc_id!r} is empty or contains a line break; fix the corpus ids")
    if doc_id in seen:
        raise CfirError(f"{where}: document id {doc_id!r} appears twice; document ids must be unique")
    seen.add(doc_id)


def write_lines(path: Path, lines: Iterable[str]) -> None:
    """Writes one item a line, through a temporary file and a rename."""
    with atomic_file(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line)
            f.write("\n")


def current(directory: Path, kind: str, version: int, **expected: Any) -> bool:
    """Whether `directory` holds a complete store of this format whose manifest has the `expected` fields (a stage
    whose store is current skips its build)."""
    try:
        manifest = read_manifest(directory, kind, version)
    except CfirError:
        return False
    return all(manifest.get(k) == v for k, v in expected.items())
