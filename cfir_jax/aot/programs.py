"""The registry of accelerator programs: each entry builds the project's own jitted function(s) for a config and a
topology, with abstract arguments that carry their shardings, ready to lower and compile.

A unit is `(command, name) -> builder(config, topology, **options) -> [Program]` (`UNITS`); a new program is one
more `@register` function here. A builder returns no program where the config does not run it (the text step of a
Full config, the Full step of CFIR's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cfir_jax.aot.topology import Topology
from cfir_jax.core.registry import Registry
from cfir_jax.model import beit3 as model_lib
from cfir_jax.model.image_tower import encode_fn
from cfir_jax.search import device_sr as dsr
from cfir_jax.training import batch as batch_lib
from cfir_jax.training.full_step import FULL_BATCH, make_full_step
from cfir_jax.training.state import make_setup, tower_kind
from cfir_jax.training.step import batch_schema, make_encoder, make_train_step

# AToMiC's image caches the device SR is sized for: base (every image the qrels judge, rounded up) and large (the
# whole collection, 11,019,202 images); a document's entity-candidate union is about 60k rows (bucket 65,536).
CACHE_ROWS = {"base": 4_000_000, "large": 11_019_202}
UNION_BUCKET = 65_536
SR_QUERY_BATCHES = (1, 8, 64)
# Entity queries per call of the exact full-cache top-K (search.device_sr's largest query block).
ENTITY_QUERY_BLOCK = 256


@dataclasses.dataclass
class Program:
    """One compiled program: `lower()` gives its jax.stages.Lowered; `knob` says what to change when it does not fit
    (given the compiled memory: 'arguments' or 'temporaries' dominate); `per_host` marks a program each host runs
    over its own devices (the others span the whole slice)."""

    name: str
    shapes: str
    lower: Callable[[], jax.stages.Lowered]
    knob: Callable[[str], str]
    per_host: bool = False
    args: tuple = ()  # the abstract arguments (with their shardings) where the builder holds them


@dataclasses.dataclass(frozen=True)
class Unit:
    """A compile-only unit of a command ('train', 'index' or 'retrieve'): `build(config, topology, **options)`
    returns its programs."""

    command: str
    name: str
    build: Callable[..., list[Program]]


# Every unit, by "command/name" (`cfir_jax.core.registry`): each builder below registers itself.
UNITS: Registry[Unit] = Registry("compile-only unit", "aot/programs", name_of=lambda u: f"{u.command}/{u.name}")


def register(command: str, name: str):
    def wrap(builder):
        UNITS.register(Unit(command, name, builder))
        return builder

    return wrap


def programs(command: str, config: ml_collections.ConfigDict, topology: Topology, **options) -> list[Program]:
    """Every program of `command` ('train', 'index' or 'retrieve') for `config` on `topology`."""
    return [p for unit in UNITS.values() if unit.command == command for p in unit.build(config, topology, **options)]


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _unlocked(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    config = config.copy_and_resolve_references()
    config.unlock()
    return config


def _train_setup(config, topology: Topology, global_batch: int | None, kind: str):
    """(the config at `global_batch`, unlocked, and its train Setup on the topology's devices), or None when the
    config trains the other tower kind ("text": the language expert on cached images; "dual": Full)."""
    if tower_kind(config) != kind:
        return None
    config = _unlocked(config)
    if global_batch:
        config.train.global_batch = int(global_batch)
    return config, make_setup(config, total_steps=1000, devices=list(topology.devices), steps_per_epoch=100)


@register("train", "train_step")
def train_step(config, topology: Topology, global_batch: int | None = None) -> list[Program]:
    """The train step at the configured (or given) global batch over the whole slice, and the evaluation encoder."""

    if (prepared := _train_setup(config, topology, global_batch, "text")) is None:
        return []
    config, setup = prepared
    tcfg = config.train
    b, length = tcfg.global_batch, tcfg.max_text_len
    mesh = setup.mesh
    batch = batch_lib.abstract(batch_schema(config), config, mesh)  # the text task's own batch schema
    frozen = _abstract(setup.abstract_frozen, setup.frozen_shardings)
    params = _abstract(setup.abstract_params, setup.param_shardings)
    step = make_train_step(config, setup)
    encoder = make_encoder(config, setup)
    shapes = (f"batch {b} x {length} tokens, mesh data={mesh.shape['data']} fsdp={mesh.shape['fsdp']}, "
              f"remat={_remat(config.model)}, grad_accum_steps={tcfg.grad_accum_steps}, "
              f"extra_negatives={tcfg.extra_negatives}")

    args = (setup.abstract_state, frozen, batch)
    return [
        Program("train_step", shapes, lambda: step.lower(*args), _step_knob(config), args=args),
        Program("eval_encoder", f"batch {b} x {length} tokens",
                lambda: encoder.lower(params, frozen, batch["ids"], batch["mask"]),
                lambda _: "lower train.global_batch (the evaluation batch) or use more chips"),
    ]


def _remat(model) -> str:
    """'False', 'True' (every layer keeps only its input) or 'True (projections)' (model.remat_policy)."""
    return f"{model.remat}" + (f" ({model.remat_policy})" if model.remat and model.remat_policy != "nothing" else "")


def _step_knob(config):
    """What to change when a train step does not fit, by what dominates its memory."""

    def knob(dominant: str) -> str:
        if dominant == "arguments":
            return "shard the state: mesh.fsdp=-1 with FSDP logical_axis_rules (configs/large.py), or more chips"
        if not config.model.remat:
            return "set model.remat=True, raise train.grad_accum_steps, or lower train.global_batch"
        return (f"raise train.grad_accum_steps (now {config.train.grad_accum_steps}) or lower train.global_batch "
                f"(now {config.train.global_batch}), or use more chips")

    return knob


@register("train", "train_full")
def train_full(config, topology: Topology, global_batch: int | None = None) -> list[Program]:
    """The D-BEiT-3 Full step (both towers, images from uint8 pixels) at the configured (or given) global batch over
    the whole slice; only for configs with train.images='pixels' (configs/base.py:full, large.py:full)."""

    if (prepared := _train_setup(config, topology, global_batch, "dual")) is None:
        return []
    config, setup = prepared
    tcfg = config.train
    b, length, size = tcfg.global_batch, tcfg.max_text_len, config.model.image_size
    mesh = setup.mesh
    batch = batch_lib.abstract(FULL_BATCH, config, mesh)  # the Full task's own batch schema
    frozen = _abstract(setup.abstract_frozen, setup.frozen_shardings)
    step = make_full_step(config, setup)
    shapes = (f"batch {b} x ({size} px + {length} tokens), mesh data={mesh.shape['data']} fsdp={mesh.shape['fsdp']}, "
              f"remat={_remat(config.model)}, {config.model.dtype}, grad_accum_steps={tcfg.grad_accum_steps}")
    args = (setup.abstract_state, frozen, batch)
    return [Program("train_full", shapes, lambda: step.lower(*args), _step_knob(config), args=args)]


@register("index", "image_encoding")
def image_encoding(config, topology: Topology, image_size: int | None = None) -> list[Program]:
    """The vision tower's image-cache encoding step: each host encodes its batch over its own devices."""

    ic = config.index.image_cache
    cfg = _unlocked(config.model)
    cfg.image_size = int(image_size or cfg.image_size)
    cfg.dtype = ic.compute_dtype
    devices = topology.host_devices
    mesh = jax.sharding.Mesh(list(devices), ("data",))
    batch = -(-int(ic.batch_size) // len(devices)) * len(devices)  # image_tower.encoder_batch on that host
    _, fn = encode_fn(cfg)
    _, state = nnx.split(model_lib.abstract_model(cfg))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), state)
    pixels = jax.ShapeDtypeStruct((batch, cfg.image_size, cfg.image_size, 3), jnp.float32,
                                  sharding=NamedSharding(mesh, P("data")))
    return [Program(f"image_encoding_{cfg.image_size}px", f"batch {batch}, {ic.compute_dtype}",
                    lambda: fn.lower(state, pixels),
                    lambda _: f"lower index.image_cache.batch_size (now {ic.batch_size})", per_host=True)]


@dataclasses.dataclass
class _Cache:
    """The resident cache of a topology's host, by shape alone (search.device_sr's abstract_cache and mesh)."""

    n: int
    dim: int
    dtype: str
    mesh: jax.sharding.Mesh
    abstract: jax.ShapeDtypeStruct

    @property
    def shards(self) -> int:
        return self.mesh.size

    def describe(self) -> str:
        return f"cache {self.n:,} x {self.dim} {self.dtype} over {self.shards} devices"

    def replicated(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, P()))


def _device_cache(config, topology: Topology, rows: int | None, dtype: str | None) -> _Cache:
    n = int(rows or CACHE_ROWS["large" if config.model.embed_dim >= 1024 else "base"])
    dtype = dtype or config.retrieval.sr_device_dtype
    mesh = dsr.make_mesh(list(topology.host_devices), shard=True)  # row-sharded over the host's devices
    return _Cache(n, config.model.embed_dim, dtype, mesh, dsr.abstract_cache(n, config.model.embed_dim, dtype, mesh))


def _cache_knob(cache: _Cache, dominant: str) -> str:
    if dominant == "arguments":
        return (f"the {cache.n:,} x {cache.dim} cache is row-sharded over {cache.shards} devices: use more chips per "
                "host (the cache dtype is already 2 bytes)")
    return "lower retrieval.sr_query_batch or the largest retrieval.sr_buckets"


@register("index", "entity_topk")
def entity_topk(config, topology: Topology, cache_rows: int | None = None, cache_dtype: str | None = None
                ) -> list[Program]:
    """The exact entity top-K over the whole resident cache (the index's accelerator backend), per host."""
    cache = _device_cache(config, topology, cache_rows, cache_dtype)
    k = int(config.index.entity_index.k)
    r = dsr.rows_per_shard(cache.n, cache.shards)
    queries = cache.replicated((ENTITY_QUERY_BLOCK, cache.dim), jnp.float32)
    lower = lambda: dsr.device_full_topk.lower(cache.abstract, queries, k=k, n=cache.n, rows_per_shard=r,  # noqa
                                               block=min(dsr.FULL_SEARCH_BLOCK, r), mesh=cache.mesh)
    return [Program("entity_topk", f"{ENTITY_QUERY_BLOCK} entities, K={k}, {cache.describe()}", lower,
                    lambda d: _cache_knob(cache, d), per_host=True)]


@register("retrieve", "device_sr")
def device_sr(config, topology: Topology, cache_rows: int | None = None, cache_dtype: str | None = None,
              query_batches: tuple[int, ...] = SR_QUERY_BATCHES) -> list[Program]:
    """The device SR (summary scores the entity-candidate union) over the resident cache, per host."""
    cache = _device_cache(config, topology, cache_rows, cache_dtype)
    r = dsr.rows_per_shard(cache.n, cache.shards)

    def lower(q: int):
        return dsr.device_sr.lower(cache.abstract, cache.replicated((q, cache.dim), jnp.float32),
                                   cache.replicated((q, UNION_BUCKET), jnp.int32), k=int(config.retrieval.top_k),
                                   rows_per_shard=r, mesh=cache.mesh)

    return [Program(f"device_sr_q{q}", f"{q} queries x union {UNION_BUCKET:,}, {cache.describe()}",
                    (lambda q=q: lower(q)), lambda d: _cache_knob(cache, d), per_host=True)
            for q in query_batches]


@register("retrieve", "filtered_search")
def filtered_search(config, topology: Topology, cache_rows: int | None = None, cache_dtype: str | None = None,
                    passing: float = 0.1) -> list[Program]:
    """The whole-cache search under a filter passing `passing` of the rows (the dense methods, CFIR's fallback),
    which scores only those rows: each shard's passing rows [S, L] gathered block by block, per host."""
    cache = _device_cache(config, topology, cache_rows, cache_dtype)
    r = dsr.rows_per_shard(cache.n, cache.shards)
    block = min(dsr.FULL_SEARCH_BLOCK, r)
    width = dsr.subset_width(math.ceil(passing * r), block)
    ids = jax.ShapeDtypeStruct((cache.shards, width), jnp.int32, sharding=NamedSharding(cache.mesh, P(dsr.AXIS, None)))
    queries = cache.replicated((1, cache.dim), jnp.float32)
    lower = lambda: dsr.device_subset_topk.lower(cache.abstract, queries, ids, k=int(config.retrieval.top_k),  # noqa
                                                 block=block, mesh=cache.mesh)
    return [Program("filtered_search", f"1 query, {passing:.0%} of the rows passing, {cache.describe()}", lower,
                    lambda d: _cache_knob(cache, d), per_host=True)]


# BART's generation (index.summaries): the query batches of a service and the paper's 1,024 input tokens.
BART_QUERY_BATCHES = (1, 8, 64)
BART_INPUT_TOKENS = 1024
BART_DTYPES = ("float32", "bfloat16")


def _bart_programs(config, topology: Topology, batches: dict[str, int], dtypes, input_tokens: int) -> list[Program]:
    """BART's jitted beam search (nlp.bart_generate, the summarizer's) at each named batch and dtype, data parallel
    over the host's devices as the summarizer runs it: parameters replicated, rows split (a batch is padded up to a
    multiple of the devices, as BartSummarizer's row buckets)."""
    s = config.index.summaries
    if s.summarizer != "bart":
        return []
    # why: the summarizer's stack (BART, its weights' readers, the tokenizer) loads only for the summary programs
    from cfir_jax.nlp import bart_generate
    from cfir_jax.nlp import summarizer as summarizer_lib

    mesh = jax.sharding.Mesh(list(topology.host_devices), ("data",))
    replicated, rows_sharding = summarizer_lib.generation_shardings(mesh)
    n = mesh.size
    out = []
    for dtype in dtypes:
        graphdef, params, raw = summarizer_lib.abstract_bart(s.bart_model, dtype)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), params)
        length = min(input_tokens, raw["max_position_embeddings"])
        gen = summarizer_lib.generation_settings(raw, None, s.max_length, s.min_length, s.num_beams,
                                                 s.length_penalty, s.no_repeat_ngram_size)
        fn = summarizer_lib.data_parallel(bart_generate.make_generate(graphdef, gen), mesh)
        for name, batch in batches.items():
            rows = -(-batch // n) * n
            ids = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=rows_sharding)
            shapes = (f"{batch} document{'s' if batch > 1 else ''}{f' ({rows} rows)' if rows != batch else ''} x "
                      f"{length} tokens, {s.num_beams} beams, <= {s.max_length} tokens, {dtype} over {n} devices")
            short = "bf16" if dtype == "bfloat16" else "f32"
            out.append(Program(f"bart_{name}_{short}", shapes, (lambda fn=fn, p=params, i=ids: fn.lower(p, i, i)),
                               lambda _: "lower index.summaries.batch_size (rows per device) or num_beams",
                               per_host=True, args=(params, ids, ids)))
    return out


@register("index", "bart_generation")
def bart_index(config, topology: Topology, dtypes=BART_DTYPES, input_tokens: int = BART_INPUT_TOKENS
               ) -> list[Program]:
    """The index's summaries: index.summaries.batch_size rows per device, every device of each host."""
    batch = int(config.index.summaries.batch_size) * len(topology.host_devices)
    return _bart_programs(config, topology, {"index": batch}, dtypes, input_tokens)


@register("retrieve", "bart_generation")
def bart_queries(config, topology: Topology, query_batches: tuple[int, ...] = BART_QUERY_BATCHES,
                 dtypes=BART_DTYPES, input_tokens: int = BART_INPUT_TOKENS) -> list[Program]:
    """A query's summary (retrieval.summarizer unset): a service's micro-batches of 1, 8 and 64 documents."""
    if config.retrieval.summarizer:
        return []
    return _bart_programs(config, topology, {f"q{q}": q for q in query_batches}, dtypes, input_tokens)
