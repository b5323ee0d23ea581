"""A reload whose entity settings changed swaps the service's entity pool while a batch is parsing with the old one
(`serve/resident.py`'s `IndexHolder.reload`, `retrieve/entity_ranking.py`'s `ParsedBy`): the batch in flight gets the
documents not yet parsed back at once, for the Retriever to parse in its own thread; the old pool's workers are gone,
the new pool parses with the new settings, and no other process is left."""

import os
import signal
import threading
import time
from types import SimpleNamespace

import ml_collections

from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.config_workers import entity_workers_config
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_workers import EntityWorkers, Settings
from cfir_jax.retrieve import entity_ranking
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve import resident

# The index's verbs entity_pool_for and the holder ask (`Index.reads_entities`, `Index.parse_entities_with`).
INDEX = SimpleNamespace(methods=("cfir",), reads_entities=lambda method=None: True,
                        parse_entities_with=lambda pool: None)


def _config(labels: str) -> ml_collections.ConfigDict:
    workers = entity_workers_config()
    workers.serve_deadline_ms = 600_000.0  # the stopped workers are never replaced: the batch waits on them
    return ml_collections.ConfigDict(dict(entity_workers=workers, serve=serve_config(),
                                          index=dict(entities=dict(spacy_model="", labels=labels))))


def _loaded(version: int) -> resident.LoadedIndex:  # over the stand-in index, as the holder and entity_pool_for read it
    return resident.LoadedIndex("W", INDEX, f"v{version}", {"embed_dim": 64}, 0.0, 0.0, 10, version=version)


def _with_entities(pool, docs: list[DocumentInput]) -> list[list[str] | None]:
    """The documents' entities as a batch reads them from the pool: those it did not parse are the batch thread's
    (None here)."""
    return list(entity_ranking.ParsedBy(pool, [d.text for d in docs], lambda rest: iter([None] * len(rest))))


class Holder(resident.IndexHolder):
    """The holder's reload as the service runs it, over a stand-in index (no workdir to load)."""

    def __init__(self, current):
        self.workdir, self.config_spec, self.overrides = "W", "", []
        self.current, self.last_reload, self._lock = current, None, threading.Lock()

    def load(self, workdir, config):
        return _loaded(self.current.version + 1)

    def verify(self, config):
        pass


def test_a_reload_that_changes_entity_settings_swaps_the_pool_under_a_batch(monkeypatch):
    others = set(_children())  # this process's children not the test's (a suite's command server, a service)
    old_config = _config("all")
    current = _loaded(1)
    current.entity_pool = old = EntityWorkers("", "all", Settings.of(old_config, "serve"))
    holder = Holder(current)
    old_pids = old.describe()["pids"]
    for pid in old_pids:  # the batch is in flight on the old pool when the reload swaps it
        os.kill(pid, signal.SIGSTOP)
    docs = [DocumentInput(f"Marie Curie worked in Paris, letter {i}.") for i in range(4)]
    outcome: dict = {}

    def batch():
        outcome["docs"] = _with_entities(old, docs)
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=batch, daemon=True)
    thread.start()
    monkeypatch.setattr(resident, "load_config", lambda *_: _config("picturable"))
    try:
        fresh = holder.reload()
        swapped = time.monotonic()
        thread.join(10)
        assert not thread.is_alive(), "the batch still waits on the pool the reload closed"
        assert outcome["at"] - swapped < 2.0
        assert outcome["docs"] == [None] * len(docs)  # unparsed: the Retriever parses them in the batch's thread
        assert fresh.entity_pool is not old and fresh.entity_pool.key == ("", "picturable")
        assert old.describe()["pids"] == [] and all(_gone(pid) for pid in old_pids)
        assert fresh.entity_pool.entities(["Marie Curie worked in Paris."]) == [["Marie Curie", "Paris"]]
        assert set(_children()) - others == set(fresh.entity_pool.describe()["pids"])
    finally:
        old.close()
        holder.close()


def test_batches_run_without_pause_through_reloads_that_change_the_entity_settings(monkeypatch):
    """Under load: the batch thread parses batch after batch with whatever pool is current while two reloads swap it;
    every batch returns, parsed by a pool or handed back unparsed, and only the last pool's workers are left."""
    others = set(_children())  # this process's children not the test's (a suite's command server, a service)
    current = _loaded(1)
    current.entity_pool = EntityWorkers("", "all", Settings.of(_config("all"), "serve"))
    holder = Holder(current)
    docs = [DocumentInput(f"Marie Curie worked in Paris, letter {i}.") for i in range(6)]
    outcomes: list = []
    stop = threading.Event()

    def batches():
        while not stop.is_set():
            try:
                outcomes.append(_with_entities(holder.current.entity_pool, docs))
            except Exception as e:  # noqa: BLE001 - the test reads what a batch raised
                outcomes.append(e)

    thread = threading.Thread(target=batches, daemon=True)
    thread.start()
    pools = [current.entity_pool]
    try:
        for labels in ("picturable", "all"):
            monkeypatch.setattr(resident, "load_config", lambda *_, labels=labels: _config(labels))
            time.sleep(0.5)
            pools.append(holder.reload().entity_pool)
        time.sleep(0.5)
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "a batch still waits on a pool a reload closed"
    finally:
        stop.set()
        for pool in pools:
            pool.close()
    assert len(outcomes) >= 3 and not [o for o in outcomes if isinstance(o, Exception)], outcomes
    texts = [d.text for d in docs]
    parsed = [list(EntityExtractor(load_spacy(None), labels).extract(texts)) for labels in ("all", "picturable")]
    # each document a pool's, or (from where a reload closed the pool that was parsing) the batch thread's to do
    for o in outcomes:
        assert all(e in (parsed[0][i], parsed[1][i], None) for i, e in enumerate(o)), o
        assert None not in o or all(e is None for e in o[o.index(None):]), o
    assert len({id(pool) for pool in pools}) == 3 and set(_children()) <= others


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] == "Z"
    except OSError:
        return True


def _children() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(entry))
    return out


def test_a_reload_that_changes_only_the_queue_keeps_the_pool(monkeypatch):
    """The pool's ahead bound follows serve.queue_size and serve.max_batch, which a running batcher never reads
    again: a reload that changes only those keeps the pool (and its workers) as it keeps the batcher (found by
    review: it swapped the pool under a running batch)."""
    made = []
    monkeypatch.setattr(resident, "EntityWorkers", lambda *a: made.append(a) or "a new pool")
    before, after = _config("all"), _config("all")
    after.serve.queue_size, after.serve.max_batch = 8, 4
    old = SimpleNamespace(key=("", "all"), settings=Settings.of(before, "serve"), degraded=False)
    assert Settings.of(after, "serve").ahead_texts != old.settings.ahead_texts
    assert resident.entity_pool_for(after, _loaded(2), old) is old and not made
    assert resident.entity_pool_for(_config("picturable"), _loaded(2), old) == "a new pool"  # the labels: a new one
