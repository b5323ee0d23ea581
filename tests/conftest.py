"""Fixtures shared by the tiers (tests/unit/<room>/, tests/e2e/). The helpers they import (`repo`, the fixtures'
modules, the workers) are in tests/helpers/, on the path by pytest's `pythonpath` setting (pyproject.toml)."""

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from repo import FIRST_RUN, ROOT, TINY_CONFIG, run_script

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    """The commands the tests run keep their compiled programs in one cache for the whole run, never in the user's
    (cfir_jax.core.compile_cache): made here by the first process (a plain run, or xdist's controller, before it
    starts the workers, which inherit it), and removed by that process at the end. The tests' own process keeps its
    programs there too, through JAX's config only (JAX is imported first), so the processes it starts choose their
    cache as a command does: CFIR_CACHE_DIR, or a test's own."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.cfir_cache_dir = tempfile.mkdtemp(prefix="cfir-test-cache-")
        os.environ["CFIR_CACHE_DIR"] = config.cfir_cache_dir
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        import jax  # noqa: F401  (loaded first: compile_cache.enable then sets JAX's config, not the environment)

        from cfir_jax.core import compile_cache

        compile_cache.enable()


def pytest_unconfigure(config):
    if getattr(config, "cfir_cache_dir", None):
        shutil.rmtree(config.cfir_cache_dir, ignore_errors=True)


# The files that take longest, longest first (their share of the suite's time, from a run's JUnit XML:
# benchmarks/suite_tiers.py lists the heaviest files). xdist's --dist loadfile hands each worker the next whole file in
# collection order, so a long file collected last (tests/unit/training/, minutes) keeps one worker busy alone while
# the other has nothing left: longest first, the two finish about together (a tenth of the suite's wall time).
LONGEST_FIRST = (
    "tests/unit/training/test_full_step.py",
    "tests/unit/training/test_trainer.py",
    "tests/e2e/test_serve_cluster_reload.py",
    "tests/unit/aot/test_compile_only.py",
    "tests/e2e/test_filters.py",
    "tests/e2e/test_serve_cluster_lifecycle.py",
    "tests/e2e/test_full_train.py",
    "tests/e2e/test_index.py",
    "tests/unit/model/test_model.py",
    "tests/e2e/test_serve_cluster.py",
    "tests/e2e/test_pipeline.py",
    "tests/unit/nlp/test_bart.py",
    "tests/e2e/test_reliability.py",
    "tests/unit/nlp/test_summaries.py",
    "tests/e2e/test_languages.py",
    "tests/unit/nlp/test_entity_workers.py",
    "tests/e2e/test_image_search.py",
    "tests/unit/cluster/test_reload_protocol.py",
    "tests/e2e/test_serve.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST first, in its order; every other file after them in collection order, and the tests
    of a file in theirs (a stable sort)."""
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))


@pytest.fixture(scope="session")
def synthetic_spm(tmp_path_factory) -> Path:
    """The tiny synthetic world's sentencepiece model (beit3.spm's id conventions): a tokenizer for every test that
    needs one but not BEiT-3's own vocabulary."""
    from cfir_jax.data.synthetic import SyntheticConfig, build_world, train_tokenizer

    world = build_world(SyntheticConfig.tiny())
    path = tmp_path_factory.mktemp("spm") / "synthetic.spm"
    texts = [d.text for d in world.documents] + [i.caption for i in world.images]
    train_tokenizer(texts, path, SyntheticConfig.tiny().vocab_size)
    return path


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """A tiny world indexed and trained once for the whole session (every test module that needs one shares it)."""
    w = tmp_path_factory.mktemp("demo")
    FIRST_RUN["index"] = run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(w),
                                    env={"CFIR_PROGRESS": "1"})
    FIRST_RUN["train"] = run_script("train.py", "--config", TINY_CONFIG, "--workdir", str(w), "-v",
                                    env={"CFIR_PROGRESS": "1"})
    return w


@pytest.fixture(scope="session")
def documents(workdir):
    """Three documents of the tiny world (fresh: their entities and summaries recomputed) and one without entities:
    [(id, text)], what the service tests send."""
    from cfir_jax.data.corpus import Corpus

    corpus = Corpus.open(workdir / "corpus")
    return [(corpus.doc_ids[i], corpus.document(i).text) for i in range(3)] + \
        [("no-entity", "Nothing named here at all, only words.")]


@pytest.fixture(scope="session")
def config():
    from cfir_jax.core.cli import load_config_file

    return load_config_file(str(ROOT / TINY_CONFIG))


@pytest.fixture(scope="module")
def world_corpus(tmp_path_factory):
    """The tiny synthetic world (real PNG images) with the first two train pairs' images broken: one corrupt, one
    missing (empty bytes). Returns (corpus, pairs, rows of the broken images)."""
    from atomic_fixtures import CORRUPT

    from cfir_jax.data.corpus_writer import write_corpus
    from cfir_jax.data.image_pipeline import train_pairs
    from cfir_jax.data.synthetic import SyntheticConfig, build_world

    world = build_world(SyntheticConfig.tiny())
    first_doc = sorted(world.qrels["train"])[0]
    broken = sorted(world.qrels["train"][first_doc])[:2]
    if len(broken) < 2:  # the first document has one image: take the second document's
        broken.append(sorted(world.qrels["train"][sorted(world.qrels["train"])[1]])[0])
    bad = {broken[0]: CORRUPT, broken[1]: b""}
    images = [dataclasses.replace(im, image=bad.get(im.image_id, im.image)) for im in world.images]
    corpus = write_corpus(tmp_path_factory.mktemp("pipe") / "c", "tiny", world.documents, images, world.qrels)
    rows = {corpus.image_ids.index(i) for i in broken}
    return corpus, train_pairs(corpus), rows
