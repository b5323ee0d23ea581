"""Ids are UTF-8 on disk whatever the locale: a collection with non-ASCII ids is written, opened, grown, masked and
cached in a process whose locale encoding is ASCII (LC_ALL=C without Python's UTF-8 mode or locale coercion)."""

import os
import subprocess
import sys
import textwrap

from repo import ROOT

SCRIPT = textwrap.dedent('''
    import locale, sys
    from pathlib import Path
    import numpy as np
    from cfir_jax.data.corpus import Corpus, Document, Image
    from cfir_jax.data.corpus_writer import write_corpus
    from cfir_jax.builders.corpus_update import stage_corpus_addition, stage_corpus_removal
    from cfir_jax.builders.image_cache_update import stage_cache_removal
    from cfir_jax.builders.image_import import import_precomputed
    from cfir_jax.stores.image_cache import ImageCache

    assert locale.getpreferredencoding(False).upper() in ("ANSI_X3.4-1968", "ASCII"), locale.getpreferredencoding()
    root, ids, doc = Path(sys.argv[1]), ["Z\\u00fcrich", "Zo\\u00eb"], "Caf\\u00e9"
    emb = [np.eye(4, dtype=np.float32)[k] for k in range(2)]
    write_corpus(root / "c", "toy", [Document(doc, "a text")],
                 [Image(i, image=b"", embedding=e) for i, e in zip(ids, emb)], {"test": {doc: {ids[0]: 1}}})
    corpus = Corpus.open(root / "c")
    assert corpus.image_ids == ids and corpus.doc_ids == [doc] and corpus.qrels("test") == {doc: {ids[0]: 1}}
    np.save(root / "emb.npy", np.stack(emb[::-1]))
    (root / "emb_ids.txt").write_bytes("\\n".join(ids[::-1]).encode("utf-8"))
    import_precomputed(root / "cache", corpus, root / "emb.npy", root / "emb_ids.txt", "float32", False)
    cache = ImageCache.open(root / "cache")
    assert cache.ids == ids
    stage_cache_removal(cache, root / "cache2", [ids[1]])
    assert ImageCache.open(root / "cache2").removed_ids == [ids[1]]
    (root / "add").mkdir()  # (a file's own name cannot be non-ASCII here: the file system encoding is ASCII too)
    row = '{"id": "M\\u00fcnchen", "bytes": "cG5n", "embedding": [0, 0, 1, 0]}\\n'
    (root / "add" / "images.jsonl").write_bytes(row.encode("utf-8"))
    stage_corpus_addition(corpus, root / "c2", root / "add")
    grown = Corpus.open(root / "c2")
    assert grown.image_ids == [*ids, "M\\u00fcnchen"], grown.image_ids
    stage_corpus_removal(grown, root / "c3", [ids[0]], [doc])
    gone = Corpus.open(root / "c3")
    assert gone.removed_image_ids == {ids[0]} and gone.removed_doc_ids == {doc}
    print("ids are UTF-8")
''')


def test_ids_are_written_and_read_as_utf8_under_an_ascii_locale(tmp_path):
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=300)
    assert done.returncode == 0 and "ids are UTF-8" in done.stdout, done.stderr[-3000:]
