"""On-disk stores shared by every stage: atomic directories and manifests.

Every stage of the pipeline (image cache, entities, summaries, entity index, trained model) writes one directory.
A directory is built under a temporary name and renamed into place only when complete, so a reader never sees a
half-written store. Its `manifest.json` records the format version, the model fingerprint, dims, dtype, counts and
the time; the next stage calls `check_manifest` to refuse a store built by another model or with other dims.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from cfir_jax.core import faults, hosts, progress
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.stores.atomic_write import (
    atomic_file,
    remove_path,
    replace_dir,
    sweep_temps,
    temp_name,
    write_json_atomic,
)
from cfir_jax.stores.integrity import MANIFEST, write_checksums

log = logging.getLogger(__name__)



@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary directory that replaces `final` only if the block finishes without error.

    Before the rename, the checksums of every file are recorded (`integrity.CHECKSUMS`: what `index.py --verify`
    checks). On an exception the temporary directory is removed; the old `final`, if any, is untouched. The
    temporary name is unique to this process, so two processes never write into one directory.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_temps(final)
    sweep_temps(final.with_name(f"{final.name}.old"))
    tmp = temp_name(final)
    tmp.mkdir()
    try:
        with faults.writing(final, tmp):
            yield tmp
            write_checksums(tmp)
            replace_dir(tmp, final)
    finally:
        remove_path(tmp) if tmp.exists() else None


def write_manifest(directory: str | os.PathLike, kind: str, version: int, **fields: Any) -> dict:
    """Writes the manifest of a store; `kind` names the store ("image_cache", ...), `version` its format."""
    manifest = {"kind": kind, "format_version": version, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
    write_json_atomic(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | os.PathLike, kind: str, version: int | None = None) -> dict:
    """Reads the manifest of a complete store, or raises a one-line StoreError saying what is wrong."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise StoreError(f"{directory}: no {kind} store here (missing directory); build it with index.py")
    if not path.is_file():
        raise StoreError(f"{directory}: incomplete {kind} store (no {MANIFEST}); rebuild it with index.py")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{path}: unreadable manifest ({e.__class__.__name__}); rebuild the store") from None
    if manifest.get("kind") != kind:
        raise StoreError(f"{path}: expected a {kind} store, found {manifest.get('kind')!r}")
    if version is not None and manifest.get("format_version") != version:
        raise StoreError(
            f"{path}: {kind} format version {manifest.get('format_version')} but this code reads {version}; rebuild it"
        )
    return manifest


def manifest_digest(manifest: dict) -> str:
    """A short sha256 of a manifest: it changes whenever its store is rebuilt (the manifest records the build time),
    so a store derived from another records it and is rebuilt or refused when the source changes."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_derived(manifest: dict, where: str | os.PathLike, **sources: Any) -> None:
    """Refuses (one line) a derived store whose recorded source fingerprints differ from the current ones."""
    for key, want in sources.items():
        have = manifest.get(key)
        if have != want:
            raise StoreError(f"{where}: stale, derived from {key}={have!r} but that is now {want!r}; "
                             "run index.py to rebuild it")


def check_manifest(manifest: dict, where: str | os.PathLike, **expected: Any) -> None:
    """Raises a one-line StoreError naming the first field of `manifest` that differs from `expected`."""
    for key, want in expected.items():
        have = manifest.get(key)
        if have != want:
            raise StoreError(
                f"{where}: store was built with {key}={have!r} but this run uses {key}={want!r}; "
                "rebuild the store or use the matching model/config"
            )


def shared_work_dir(out_dir: str | Path, key: dict) -> Path:
    """The work directory `.<name>.building` beside `out_dir` where every process of a build writes its finished
    shards, kept from an interrupted build of the same `key` and otherwise started over. Process 0 alone decides,
    before the others look (a barrier), so no process deletes shards another is writing."""
    out_dir = Path(out_dir)
    work = out_dir.with_name(f".{out_dir.name}.building")
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


def partial_dir(out_dir: str | Path) -> Path:
    """Where a build of `out_dir` keeps its finished chunks until the store is complete."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f"{out_dir.name}.partial")


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


def commit_on_main(out_dir: str | Path, kind: str, chunks: Iterator[Any], assemble: Callable[[Iterator[Any]], Any]
                   ) -> dict:
    """Runs `assemble(chunks)` (which writes the store at `out_dir` through `atomic_dir`) on process 0, then removes
    the chunks; the other processes run `chunks` to its end (computing their own, see `iter_chunks`). Every process
    returns the committed store's manifest, read after a barrier."""
    if hosts.is_main():
        assemble(chunks)
        finish_chunks(out_dir)
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


def read_lines(path: Path, expected: int, store_dir: Path) -> list[str]:
    """Reads a line-per-item file and checks its length against the manifest."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; the store {store_dir} is incomplete, rebuild it") from None
    except UnicodeDecodeError:
        raise StoreError(f"{path}: not UTF-8 text; the store {store_dir} is corrupt, rebuild it") from None
    lines = text.split("\n")[:-1] if text else []
    if len(lines) != expected:
        raise StoreError(f"{path}: {len(lines)} lines but the manifest says {expected}; rebuild the store")
    return lines
