"""The one recipe for the stores of NLP output per document (entities, summaries) under an add of the collection:
the new documents run through the same NLP as the build, in resumable chunks, and appended to the old store, so the
result equals a store built over the union in one go (`append_documents`); `after_add` is the change step both
declare."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cfir_jax.builders.chunks import commit_on_main, iter_chunks
from cfir_jax.builders.corpus_update import documents_added
from cfir_jax.builders.descriptor import EXTEND, Step
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import StoreError
from cfir_jax.data.corpus import Corpus
from cfir_jax.stores.atomic_write import link_tree
from cfir_jax.stores.integrity import CHECKSUMS


@dataclasses.dataclass(frozen=True)
class DocumentNLP:
    """What runs over the added documents: the `settings` the store records (an addition must match them),
    `item(row)` the input of the corpus' document `row`, `process(inputs)` its outputs, and `assemble(out_dir,
    chunks)` writing the old store with the chunks' outputs appended."""

    settings: dict
    item: Callable[[int], Any]
    process: Callable[[list], list]
    assemble: Callable[[Path, Iterator], None]


def check_base(store, corpus: Corpus, first_new_doc: int, what: str) -> None:
    """One line when a per-document store (entities, summaries) is not of the first `first_new_doc` documents."""
    if store.doc_ids != corpus.doc_ids[:first_new_doc]:
        raise StoreError(f"{store.directory}: the {what} are not of the first {first_new_doc} documents of "
                         f"{corpus.path}; rebuild them with index.py")


@dataclasses.dataclass(frozen=True)
class PerDocumentStore:
    """Which per-document store an add extends: `what` names it (its directory, its chunks' work directory and its
    progress bar), `label` says what its settings are of ("entity", "summary"), `chunk_size` documents a chunk."""

    what: str
    label: str
    chunk_size: int


def append_documents(store, corpus: Corpus, first_new_doc: int, out_dir: str | os.PathLike,
                     work_dir: str | os.PathLike, kind: PerDocumentStore,
                     nlp: Callable[[], DocumentNLP]) -> dict | None:
    """The store `kind.what` with the NLP output of the documents [first_new_doc, N) of the union `corpus` appended
    (chunks kept in `work_dir/what` across a kill), staged in `out_dir`; returns its manifest. Images alone added:
    the store linked as it is, and None. `nlp()` is made only when there are documents (spaCy and BART load then);
    a store made with other settings is refused in one line (`kind.label`: what the settings are of)."""
    what, label, chunk_size = kind.what, kind.label, kind.chunk_size
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    check_base(store, corpus, first_new_doc, what)
    if first_new_doc == corpus.num_documents:  # images alone were added: the store is current as it is
        link_tree(store.directory, out_dir, skip=(CHECKSUMS,))
        return None
    run = nlp()
    differ = [k for k, v in run.settings.items() if store.manifest.get(k) != json.loads(json.dumps(v))]
    if differ:
        raise StoreError(f"{store.directory}: built with other {label} settings ({', '.join(differ)}); rebuild it "
                         "with index.py")
    docs = ((corpus.doc_ids[i], run.item(i)) for i in range(first_new_doc, corpus.num_documents))
    work = work_dir / what
    chunks = iter_chunks(work, docs, run.process, run.settings, chunk_size, corpus.num_documents - first_new_doc,
                         desc=what)
    return commit_on_main(out_dir, what, chunks, lambda c: run.assemble(out_dir, c), work=work)


def after_add(name: str, stage: Callable[..., dict]) -> Step:
    """The change step of a per-document store: `stage(config, old store, union corpus, first new document, out,
    work)`, run when the add brought documents."""
    def run(change: ChangeRun, out: Path) -> dict:
        return stage(change.config, change.old(name), change.new("corpus"), change.old("corpus").num_documents, out,
                     change.work)

    return Step(EXTEND, run, when=lambda change: documents_added(change) > 0)
