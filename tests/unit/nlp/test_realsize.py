"""benchmarks/realsize.py: a workdir at the paper's shapes built from shapes alone (here the tiny size, seconds)."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import realsize  # benchmarks/realsize.py (pyproject's pytest pythonpath names benchmarks/)
from repo import ROOT


@pytest.mark.benchmark
@pytest.mark.slow  # 65 s at load 11 (the encoder's init and BART's first compile); the session workdir apart
def test_tiny_realsize_workdir_opens_and_answers_with_bart(tmp_path, workdir):
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.nlp.bart_summarizer import BartSummarizer
    from cfir_jax.retrieve.pipeline import DocumentInput, Retriever

    work = realsize.build(tmp_path / "rs", "tiny", rows=3000, world=Path(workdir))
    # The trained demo model is not copied: the random encoder is the model that scores queries.
    model = json.loads((work / "model" / "manifest.json").read_text())
    assert model["text_fingerprint"] == json.loads((work / "encoder" / "manifest.json").read_text())["text_fingerprint"]
    config = workdir_config(work)
    assert config.index.summaries.summarizer == "bart" and config.index.summaries.num_beams == 4
    assert config.retrieval.top_k == 1000 and config.index.entity_index.k == 200
    retriever = Retriever(config, work, "cfir")
    assert (retriever.cache.num_images, retriever.cache.dim) == (3000, 64)
    assert retriever.cache.ids[0] == retriever.corpus.image_ids[0]  # the corpus' images come first
    lengths = np.diff(retriever.entity_index.offsets)
    assert (lengths == 200).all() and retriever.entity_index.candidates_array.max() < 3000
    for row in range(3):  # each list holds distinct rows
        assert len(np.unique(retriever.entity_index.candidates([row])[0])) == 200
    doc = retriever.corpus.document(0)
    result = retriever.retrieve(DocumentInput(doc.text, "q"))
    assert isinstance(retriever.summarizer(), BartSummarizer) and len(result.hits) > 0
    assert result.summary == retriever.summarizer().summarize([doc.text])[0]
    # Both BART directories carry the published layer counts' tiny stand-ins and a tokenizer.
    for name, decoder_layers in (("bart-large-cnn", 2), ("distilbart-cnn-12-6", 1)):
        cfg = json.loads((tmp_path / "rs" / "bart" / name / "config.json").read_text())
        assert cfg["decoder_layers"] == decoder_layers and (tmp_path / "rs" / "bart" / name / "vocab.json").is_file()
    # A second build finds every part at size and rewrites nothing.
    before = os.stat(work / "image_cache" / "embeddings.npy").st_mtime_ns
    realsize.build(tmp_path / "rs", "tiny", rows=3000, world=Path(workdir))
    assert os.stat(work / "image_cache" / "embeddings.npy").st_mtime_ns == before


def test_realsize_refuses_an_output_inside_the_repository():
    import subprocess

    out = subprocess.run([sys.executable, "benchmarks/realsize.py", "build", "--out", str(ROOT / "rs"), "--size",
                          "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert out.returncode != 0 and "inside the repository" in out.stderr and "Traceback" not in out.stderr
    assert not (ROOT / "rs").exists()


@pytest.mark.benchmark
@pytest.mark.slow  # the session workdir (index.py and train.py on the tiny world); the build itself takes seconds
def test_a_world_larger_than_the_rows_asked_keeps_every_image_it_has(tmp_path, workdir):
    """`accelerator.sh --parts serve --world W` with a world of more images than --serve-rows built a cache cut to
    the rows asked under an entity index of the world's rows: the service refused it ('entity_index: id 4999 is
    outside [0, 2,000)'). The cache keeps every image of the world, first, and the lists stay within it."""
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
    from cfir_jax.serve.resident import check_complete

    world_images = len((Path(workdir) / "image_cache" / "ids.txt").read_text().split())
    rows = world_images // 2
    work = realsize.build(tmp_path / "rs", "tiny", rows=rows, world=Path(workdir))
    check_complete(work)
    retriever = Retriever(workdir_config(work), work, "cfir", load_nlp=False)
    assert retriever.cache.num_images == world_images and retriever.cache.ids == retriever.corpus.image_ids
    assert retriever.entity_index.candidates_array.max() < world_images
    assert retriever.entity_index.k == world_images  # K = 200 lists of distinct rows cannot outgrow the cache
    doc = retriever.corpus.document(0)
    result = retriever.retrieve(DocumentInput(doc.text, "q", entities=list(retriever.entity_index.vocab[:2]),
                                              summary="a summary of the document"))
    assert len(result.hits) == world_images and result.num_candidates == world_images
