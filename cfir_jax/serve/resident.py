"""The resident index: a workdir's served methods opened in the library's `Index` (the one query core) and warmed
once, and swapped whole when the workdir is reloaded.

A reload (SIGHUP, POST /v1/admin/reload) opens a new `Index` off to the side while the old one keeps serving.
It replaces the old one only when the workdir is complete (index.json present, no store half-written, every store
the Retriever opens valid) and its model is of the same family (the same architecture: a new index of another
model size or embedding width would change what the service's clients get without a restart telling them). A
batch already running finishes on the index it started with; a refused reload keeps the old index and records
why (the log, GET /readyz).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import ml_collections

from cfir_jax.api.index import Index
from cfir_jax.core import cli
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.core.memory import release_freed
from cfir_jax.nlp.entity_workers import EntityWorkers, Settings, label_spec
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve.verifier import store_problems
from cfir_jax.stores import layout as workdir_layout
from cfir_jax.stores import versions
from cfir_jax.stores.atomic_write import builds_in_progress
from cfir_jax.stores.contract import manifest_digest
from cfir_jax.stores.layout import Layout

log = logging.getLogger("cfir_jax.serve")

# What a model family is: the architecture fields of the model's manifest (weights may differ: a retrained model).
FAMILY_KEYS = ("embed_dim", "num_layers", "num_heads", "ffn_dim", "vocab_size", "image_size", "patch_size")
WARM_TEXT_NO_ENTITY = "nothing named here at all."
WARM_TEXT_UNKNOWN = "Quentin Zabrowski of the Xylo Harbour Society met Priya Okonkwo in Vennmark."


def load_config(workdir: str, config_spec: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """The config the index was built with (upgraded: fields older workdirs lack take their defaults) or
    `config_spec`, then the `--config.x.y=v` overrides, as `cli.parse` reads it: what a reload reads again."""
    return cli.load(config_spec, workdir, overrides)


def config_overrides(argv: Sequence[str]) -> list[str]:
    """The `--config.x.y=v` (or `--config.x.y v`) arguments of a command line."""
    out, argv = [], list(argv)
    for n, arg in enumerate(argv):
        if arg.startswith("--config."):
            out.append(arg if "=" in arg or n + 1 >= len(argv) else f"{arg}={argv[n + 1]}")
    return out


def check_complete(workdir: str | Path) -> None:
    """Refuses (one line) a workdir that is not a complete index: no index.json, a store directory without its
    manifest (written last), or a store build still in progress beside it (`atomic_write.builds_in_progress`). The
    training runs' directories hold no manifest: a retriever reads the models they export."""
    layout = Layout.of(workdir)
    if not layout.root.is_dir():
        raise CfirError(f"{layout.root}: no index here (missing directory)")
    if not layout.index_json.is_file():
        raise CfirError(f"{layout.root}: incomplete index (no index.json): index.py has not finished")
    for name in workdir_layout.of_kind(workdir_layout.STORE, workdir_layout.DERIVED):
        store = layout.root / name
        busy = [p.name for p in builds_in_progress(store)]
        if busy:
            raise CfirError(f"{store}: a build is in progress or was interrupted ({', '.join(busy)}): let index.py "
                            "finish it")
        if store.is_dir() and not (store / "manifest.json").is_file():
            raise CfirError(f"{store}: incomplete store (no manifest.json): let index.py finish it")


def check_intact(workdir: str | Path) -> None:
    """Refuses (one line) a workdir that is incomplete (`check_complete`) or whose bytes differ from their checksums,
    naming the first damaged file and how many more there are."""
    check_complete(workdir)
    problems = store_problems(workdir)
    if problems:
        more = f" (and {len(problems) - 1} more: index.py --verify names them)" if len(problems) > 1 else ""
        raise CfirError(f"damaged: {problems[0]}{more}")


def _model_manifest(layout: Layout) -> dict:
    # index.json names the index encoder relative to the workdir ("encoder"), not to where the service runs
    for directory in (layout.model, layout.root / (json.loads(layout.index_json.read_text()).get("encoder") or
                                                   layout.encoder)):
        path = directory / "manifest.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise CfirError(f"{layout.root}: no model (W/model) and no index encoder to take its family from")


def model_family(workdir: str | Path) -> dict:
    """The architecture of the workdir's model (or its index encoder when untrained): {field: value}."""
    config = _model_manifest(Layout.of(workdir)).get("model_config", {})
    return {key: config.get(key) for key in FAMILY_KEYS}


def index_fingerprint(workdir: str | Path) -> str:
    """A short digest of the workdir's version and every store's and the model's manifest: it changes whenever any
    of them is rebuilt, and with every committed change."""
    layout = Layout.of(workdir)
    parts = [f"version={versions.current_version(layout)}"]
    for name in workdir_layout.of_kind(workdir_layout.STORE):  # the derived copies follow from these
        path = layout.root / name / "manifest.json"
        if path.is_file():
            parts.append(f"{name}={manifest_digest(json.loads(path.read_text()))}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def warm_up(index: Index, method: str, max_batch: int) -> None:
    """Runs every shape the service will send to `method` of `index` before it says it is ready: a document with
    entities and one without (the whole-cache fallback) at each power-of-two batch size up to max_batch (the encoders
    pad to their own batch; the device SR pads query batches to powers of two), and on the device backend every SR
    bucket at every query batch (`Index.warm_scoring`).
    spaCy compiles nothing: the document is parsed once, and the larger batches are given its entities."""
    text = index.sample_text() or WARM_TEXT_NO_ENTITY
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    entities = list(index.retrieve([DocumentInput(text, "warm-0")], method)[0].entities)
    for size in [*sizes, max_batch][1:]:  # the first (1) was the parse
        index.retrieve([DocumentInput(text, f"warm-{i}", entities=entities) for i in range(size)], method)
    index.retrieve([DocumentInput(WARM_TEXT_NO_ENTITY, "warm-fallback")], method)
    index.retrieve([DocumentInput(WARM_TEXT_UNKNOWN, "warm-unknown")], method)  # entities searched at query time
    index.warm_scoring(max_batch, method)  # on the device backend: every SR bucket at each query batch


@dataclasses.dataclass
class LoadedIndex:
    """One generation of the resident index: the library's `Index` with the served methods open (the first the
    default; on a Ray front, their unions scored by the shards), and what identifies it."""

    workdir: str
    index: Index
    fingerprint: str
    family: dict
    loaded_at: float  # time.time()
    load_seconds: float
    max_top_k: int  # retrieval.top_k: the most hits a search keeps
    entity_pool: object | None = None  # EntityWorkers parsing batches on every core (entity_workers.serve), or None
    version: int = 0  # the workdir's version (index.json) its stores were opened at

    @property
    def methods(self) -> tuple[str, ...]:
        """The served methods, the default first."""
        return self.index.methods

    def use_pool(self, pool) -> None:
        """`pool` (`entity_pool_for`'s) parses this generation's batches, while the index encodes them."""
        self.entity_pool = pool
        self.index.parse_entities_with(pool)

    def describe(self) -> dict:
        return {"workdir": self.workdir, "version": self.version, "fingerprint": self.fingerprint,
                "methods": list(self.methods),
                "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at)),
                "load_seconds": round(self.load_seconds, 2), "max_top_k": self.max_top_k,
                "model_family": self.family}


def load_index(workdir: str, config: ml_collections.ConfigDict, methods: Sequence[str], max_batch: int,
               scoring=None, warm=warm_up, make=None) -> LoadedIndex:
    """Checks the workdir is complete, opens an `Index` with every served method and warms each (seconds; minutes at
    scale). scoring: what scores the unions (`Index`'s: a Ray front's shards; None: this process); warm(index, method,
    max_batch): what warms a method; make: `Index`'s (a test's stand-in pipeline)."""
    t0 = time.perf_counter()
    index = Index(config, workdir, methods[0], scoring=scoring, make=make)
    with versions.reading(Layout.of(workdir)):  # the checks and every method of the same version
        check_complete(workdir)
        fingerprint, family = index_fingerprint(workdir), model_family(workdir)
        version = index.open_methods(methods)
    index.warm_up(lambda method: warm(index, method, max_batch), int(config.serve.summary_cache))
    if index_fingerprint(workdir) != fingerprint:  # rebuilt while it was loading: what was read may be mixed
        raise CfirError(f"{workdir}: the index changed while it was loading; reload again when index.py is done")
    return LoadedIndex(workdir, index, fingerprint, family, time.time(), time.perf_counter() - t0,
                       int(config.retrieval.top_k), version=version)


class IndexHolder:
    """The current LoadedIndex and its reloads (one at a time), with the outcome of the last one."""

    def __init__(self, workdir: str, config_spec: str, overrides: Sequence[str], methods: Sequence[str],
                 max_batch: int, config: ml_collections.ConfigDict | None = None):
        self.workdir, self.config_spec, self.overrides = workdir, config_spec, list(overrides)
        self.methods, self.max_batch = tuple(methods), max_batch
        config = config if config is not None else load_config(workdir, config_spec, overrides)
        self.current = self.load(workdir, config)
        self.current.use_pool(entity_pool_for(config, self.current, None))
        self.last_reload: dict | None = None  # {"ok": bool, "at": ..., "error"/"fingerprint": ...}
        self._lock = threading.Lock()

    def load(self, workdir: str, config: ml_collections.ConfigDict) -> LoadedIndex:
        """One generation of the index (the cluster's holder loads its shards and fronts here instead)."""
        return load_index(workdir, config, self.methods, self.max_batch)

    def verify(self, config: ml_collections.ConfigDict) -> None:
        """Before a reload loads anything: every byte checked (serve.verify_on_reload; CfirError when damaged). A
        cluster's front leaves it to the command's one check of the version it serves."""
        if config.serve.verify_on_reload:
            check_intact(self.workdir)

    def close(self) -> None:
        """Stops the entity workers (after the batcher has drained)."""
        if self.current.entity_pool is not None:
            self.current.entity_pool.close()

    @property
    def reloading(self) -> bool:
        return self._lock.locked()

    def reload(self) -> LoadedIndex:
        """Loads the workdir again beside the serving index and swaps it in when complete and of the same family;
        raises CfirError (and keeps the old index) otherwise, or when a reload is already running."""
        if not self._lock.acquire(blocking=False):
            raise CfirError("a reload is already running")
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            config = load_config(self.workdir, self.config_spec, self.overrides)
            self.verify(config)
            fresh = self.load(self.workdir, config)
            if fresh.family != self.current.family:
                changed = ", ".join(f"{k} {self.current.family[k]} -> {fresh.family[k]}" for k in FAMILY_KEYS
                                    if fresh.family[k] != self.current.family[k])
                raise CfirError(f"{self.workdir}: the new index's model is of another family ({changed}); restart "
                                "the service to serve it")
            fresh.use_pool(entity_pool_for(config, fresh, self.current.entity_pool))
            old, self.current = self.current, fresh  # one reference swap: the next batch reads the new index
            if old.entity_pool is not None and old.entity_pool is not fresh.entity_pool:
                old.entity_pool.close()  # a batch parsing with it parses the rest in its own thread (PoolClosed)
            # The pages the previous generation freed go back to the system (glibc keeps them otherwise: a 30-minute
            # soak's server grew 31% over its reloads; 6 reloads of the demo's index, 369 -> 461 MiB without, 363 ->
            # 411 with; cfir_jax.core.memory)
            release_freed()
        except Exception as e:  # noqa: BLE001 - whatever failed, the old index keeps serving
            reason = first_line(e) if isinstance(e, CfirError) else f"{type(e).__name__}: {e}"
            self.last_reload = {"ok": False, "at": at, "error": reason}
            serving = f"version {self.current.version} ({self.current.fingerprint})"
            if isinstance(e, CfirError):
                log.warning("reload refused, still serving %s: %s", serving, reason)
            else:
                log.exception("reload failed, still serving %s", serving)
            raise CfirError(reason) from None
        finally:
            self._lock.release()
        self.last_reload = {"ok": True, "at": at, "version": fresh.version, "fingerprint": fresh.fingerprint}
        log.warning("reloaded %s: version %d -> %d, index %s -> %s in %.1f s", self.workdir, old.version,
                    fresh.version, old.fingerprint, fresh.fingerprint, fresh.load_seconds)
        return fresh


def entity_pool_for(config: ml_collections.ConfigDict, index: LoadedIndex, old):
    """The worker pool an index's batches use (`cfir_jax.nlp.entity_workers`): `old` when it parses the same way
    (spaCy model, labels, settings), a new one of entity_workers.serve processes otherwise; None when fewer than 2
    or no served method reads entities."""
    settings = Settings.of(config, "serve")
    if settings.workers < 2 or not any(index.index.reads_entities(m) for m in index.methods):
        return None
    e = config.index.entities
    if old is not None and old.key == (e.spacy_model or "", label_spec(e.labels)) and old.settings == settings \
            and not old.degraded:
        return old
    return EntityWorkers(e.spacy_model, e.labels, settings)
