"""The one dependency graph (each store's declared `made_from`): the closing table's stale rows and the change loop's
order both follow it, and what each builder reads is in it."""

from __future__ import annotations

import json

import pytest

from cfir_jax.builders import descriptor
from cfir_jax.builders.stage_report import StageReport, stale_reports
from cfir_jax.stores.layout import Directory, Layout


def _downstream(graph: dict, rebuilt: str, rows: set[str]) -> set[str]:
    """Every store of the closing table's `rows` derived from `rebuilt`, directly or through other such stores. A
    training run is no row: W/encoder, made from the caption pretraining's run (made from the image cache), is kept
    by its stage once trained, so a rebuilt image cache does not make it stale."""
    out: set[str] = set()
    grown = True
    while grown:
        grown = False
        for name, sources in graph.items():
            if name in rows and name not in out and name != rebuilt and ({rebuilt} | out) & set(sources):
                out.add(name)
                grown = True
    return out


@pytest.fixture
def built(tmp_path):
    """A workdir where every declared store has a manifest."""
    layout = Layout.of(tmp_path)
    for name in descriptor.store_names():
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"kind": name}))
    return layout


@pytest.mark.parametrize("rebuilt", descriptor.stages())
def test_the_stale_rows_are_the_stores_the_graph_derives_from_a_rebuilt_one(built, rebuilt):
    """The stages and the stores other commands make that stand downstream of a rebuilt stage read STALE, and no
    other store does."""
    graph, stages = descriptor.graph(), descriptor.stages()
    reports = [StageReport(rebuilt, "-", 0.0, built.root / rebuilt)]
    stale = {r.name for r in stale_reports(built, reports, stages)}
    reported = set(stages) | set(descriptor.later())
    assert stale == _downstream(graph, rebuilt, reported), rebuilt


def test_a_caption_change_marks_the_lexical_store_stale_when_the_image_cache_stands(built):
    """The corpus rebuilt (new captions) while the image cache was reused: lexical reads the captions."""
    reports = [StageReport("corpus", "-", 0.0, built.corpus), StageReport("image_cache", "-", 0.0, built.image_cache,
                                                                             reused=True)]
    stale = {r.name: r.stale_because for r in stale_reports(built, reports, descriptor.stages())}
    assert stale["lexical"] == "corpus rebuilt" and stale["image_text"] == "corpus rebuilt"
    assert stale["entity_index"] == "entities, corpus rebuilt"


def test_the_entity_index_is_made_from_what_its_builder_reads():
    assert set(descriptor.get("entity_index").made_from) == {"corpus", "entities", "image_cache", "encoder"}
    assert set(descriptor.get("lexical").made_from) == {"corpus", "image_cache"}


def test_the_change_loop_runs_each_store_after_the_stores_it_is_made_from():
    order = [s.name for s in descriptor.stores()]
    for store in descriptor.stores():
        for source in store.made_from:
            if source in order:
                assert order.index(source) < order.index(store.name), (source, store.name)


def test_the_order_is_derived_from_made_from_with_ties_broken_by_name():
    """No order is kept by hand: each store stands after what it is made from, and of the stores ready at once the
    first by name goes first."""
    order = descriptor.store_names()
    assert order[0] == "corpus" and order.index("entities") < order.index("image_cache")  # both from the corpus alone
    assert order.index("pretrain") < order.index("encoder") < order.index("entity_index")
    ahead = Directory("aaa", made_from=("summaries",))  # first by name, yet after what it is made from
    with descriptor.declaring(ahead):
        names = descriptor.store_names()
        assert names.index("summaries") < names.index("aaa") and names[0] == "corpus"


def test_a_circle_of_made_from_is_refused():
    a, b = Directory("circle_a", made_from=("circle_b",)), Directory("circle_b", made_from=("circle_a",))
    with descriptor.declaring(a, b), pytest.raises(ValueError, match=r"\['circle_a', 'circle_b'\].*circle"):
        descriptor.stores()


def test_a_stage_of_an_undeclared_directory_is_refused():
    with descriptor.declaring(descriptor.Stage("nowhere")), pytest.raises(ValueError, match="nowhere"):
        descriptor.stores()


def test_every_store_of_the_change_loop_can_be_opened_and_every_stage_is_linked():
    for store in descriptor.stores():
        if any(store.changes.of(op) and store.changes.of(op).run for op in descriptor.OPS):
            assert store.reader is not None, store.name
    assert set(descriptor.stages()) <= set(descriptor.linked())


def test_each_store_retrieval_opens_on_request_is_declared_with_that_same_reader():
    from cfir_jax.stores import readers

    registered = readers.optional()
    assert {r.name for r in registered} >= {"entity_text_match", "image_text", "lexical"}
    for reader in registered:
        assert descriptor.get(reader.name).reader is reader, reader.name
    with pytest.raises(ValueError, match="names the reader of 'lexical'"):
        descriptor.declare(descriptor.Stage("other", reader=readers.get("lexical")))


def test_each_declared_config_section_is_in_the_config():
    from configs.base import get_config

    config = get_config("runlocal")
    for store in descriptor.stores():
        if store.config:
            node = config
            for key in store.config.split("."):
                assert key in node, (store.name, store.config)
                node = node[key]
