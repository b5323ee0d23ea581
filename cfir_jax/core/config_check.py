"""Each config section's check, one per section, run once where a config is loaded (`cfir_jax.core.cli.load`: the
commands, and a service's reload): a value the code cannot run with is refused in one line naming the field and its
choices, before any store is opened or any step compiled. The choices are defined here, on the floor, and the rooms
that act on them import them from here.

A field an experiment leaves unset (a placeholder, None) is not checked: a command that needs it says so.
An older workdir's config is upgraded first (`cfir_jax.core.config_upgrade`), so every field is there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import ml_collections

from cfir_jax.core.errors import CfirError
from cfir_jax.core.image_field_types import zone_of
from cfir_jax.core.languages import check_languages
from cfir_jax.core.registry import Registry

# train.text: what the language expert reads of a train document (or an image's caption, the demo's pretraining).
TRAIN_TEXTS = ("summary", "document", "caption")
# train.images -> the tower trained: the cached embeddings train the text tower, the images both (D-BEiT-3 Full).
TOWERS = {"cache": "text", "pixels": "dual"}
SR_MODES = ("exact", "fast")  # retrieval.sr and retrieval.eval_sr
SR_BACKENDS = ("auto", "device", "cpu")
SR_DEVICE_SHARDS = ("auto", "always", "never")
SR_DEVICE_DTYPES = ("float16", "bfloat16")
UNKNOWN_ENTITY_RULES = ("ignore", "search")
RETRIEVAL_MODELS = ("", "full")
# retrieval.measures (retrieve.py --measures): trec_eval -c, trec_eval without -c, the authors' code, or both.
MEASURE_SETS = ("trec_eval", "trec_eval_no_c", "authors", "both")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ServeEngine:
    """A choice of serve.engine: `serve(workdir, config, config_spec, argv, method, host, port, address)` runs the
    service until it is stopped."""

    name: str
    serve: Callable[..., None]


# serve.engine -> what serves it. Each engine is declared beside its code, in a module named `serve` of the room that
# runs it (`cfir_jax/commands/serve.py`: "local", this one process; `cfir_jax/cluster/serve.py`: "ray", Ray Serve),
# which stays light: the registry finds it by that name (`cfir_jax.core.registry`), so this floor names no engine.
SERVE_ENGINES: Registry[ServeEngine] = Registry("serving engine", "*/serve")


def _one_of(section: str, node: ml_collections.ConfigDict, key: str, choices: Sequence | Registry) -> None:
    value = node[key]
    if value is not None and value not in choices:
        names = sorted(choices) if isinstance(choices, Registry) else choices
        raise CfirError(f"{section}.{key}={value!r}: use one of {', '.join(repr(c) for c in names)}")


def check_model(m: ml_collections.ConfigDict) -> None:
    if m.image_size % m.patch_size:
        raise CfirError(f"model.image_size={m.image_size} is not a multiple of model.patch_size={m.patch_size}")
    _one_of("model", m, "dtype", DTYPES)
    _one_of("model", m, "param_dtype", DTYPES)


def check_mesh(m: ml_collections.ConfigDict) -> None:
    for axis in ("data", "fsdp"):
        if m[axis] == 0 or m[axis] < -1:
            raise CfirError(f"mesh.{axis}={m[axis]}: a number of devices, or -1 for what the other axis leaves")


def check_train(t: ml_collections.ConfigDict) -> None:
    _one_of("train", t, "text", TRAIN_TEXTS)
    _one_of("train", t, "images", TOWERS)
    if t.images == "pixels" and t.text not in (None, "document"):
        raise CfirError(f"train.images='pixels' (D-BEiT-3 Full) trains on document text: train.text={t.text!r} must "
                        "be 'document'")


def check_index(i: ml_collections.ConfigDict) -> None:
    _one_of("index.corpus", i.corpus, "source", ("atomic", "synthetic", "files"))
    _one_of("index.image_cache", i.image_cache, "dtype", DTYPES)
    if "languages" in i:
        check_languages(i.languages)
    if "fields" in i:
        try:
            zone_of(i.fields.timezone)
        except ValueError as e:
            raise CfirError(f"index.fields.timezone: {e}") from None
    d = i.get("duplicates")
    if d is not None and not 0.0 < float(d.threshold) <= 1.0:
        raise CfirError(f"index.duplicates.threshold={d.threshold}: a cosine in (0, 1] (0.98: near-identical images)")
    if d is not None and not 1 <= int(d.neighbours) <= int(d.max_neighbours):
        raise CfirError(f"index.duplicates.neighbours={d.neighbours}: at least 1 and at most max_neighbours="
                        f"{d.max_neighbours}")
    if d is not None:
        _one_of("index.duplicates", d, "backend", ("auto", "exact", "scann", "partition"))


def check_retrieval(r: ml_collections.ConfigDict) -> None:
    for key, choices in (("sr", SR_MODES), ("eval_sr", SR_MODES), ("sr_backend", SR_BACKENDS),
                         ("sr_device_shard", SR_DEVICE_SHARDS), ("sr_device_dtype", SR_DEVICE_DTYPES),
                         ("unknown_entities", UNKNOWN_ENTITY_RULES), ("model", RETRIEVAL_MODELS),
                         ("measures", MEASURE_SETS)):
        _one_of("retrieval", r, key, choices)
    rerank = r.rerank
    if int(rerank.top_n) < 2:
        raise CfirError(f"retrieval.rerank.top_n={rerank.top_n}: a list to re-rank needs at least 2 candidates")
    if not 0.0 < float(rerank.heldout) < 1.0:
        raise CfirError(f"retrieval.rerank.heldout={rerank.heldout}: a fraction of the lists, between 0 and 1")


def check_serve(s: ml_collections.ConfigDict) -> None:
    if s.max_batch < 1:
        raise CfirError(f"serve.max_batch={s.max_batch}: at least 1 (1: micro-batching off)")
    if s.max_batch_docs > s.queue_size:
        raise CfirError(f"serve.max_batch_docs={s.max_batch_docs} exceeds serve.queue_size={s.queue_size}: a full "
                        "batch request could never be queued")
    _one_of("serve", s, "engine", SERVE_ENGINES)
    for key in ("shards", "shard_replicas", "front_replicas", "gateway_replicas", "max_image_bytes", "max_text_bytes",
                "max_image_pixels", "image_queue_size", "max_filter_conditions", "max_filter_values",
                "max_filter_bytes"):
        if s[key] < 1:
            raise CfirError(f"serve.{key}={s[key]}: at least 1")
    if s.body_deadline_ms <= 0:
        raise CfirError(f"serve.body_deadline_ms={s.body_deadline_ms}: a positive number of milliseconds")
    if s.shard_timeout_s <= 0:
        raise CfirError(f"serve.shard_timeout_s={s.shard_timeout_s}: a positive number of seconds")
    for key in ("front_num_cpus", "shard_num_cpus", "gateway_num_cpus", "front_num_gpus", "head_num_cpus"):
        if s[key] < 0:
            raise CfirError(f"serve.{key}={s[key]}: at least 0")
    if s.ready_timeout_s <= 0:
        raise CfirError(f"serve.ready_timeout_s={s.ready_timeout_s}: a positive number of seconds")


def check_entity_workers(w: ml_collections.ConfigDict) -> None:
    for key in ("serve", "bulk", "index", "max_restarts"):
        if int(w[key]) < 0:
            raise CfirError(f"entity_workers.{key}={w[key]}: at least 0")
    for key in ("serve_deadline_ms", "deadline_ms", "restart_window_s"):
        if float(w[key]) <= 0:
            raise CfirError(f"entity_workers.{key}={w[key]}: a positive number")


SECTIONS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "model": check_model, "mesh": check_mesh, "train": check_train, "index": check_index,
    "retrieval": check_retrieval, "serve": check_serve, "entity_workers": check_entity_workers}


def check(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Runs every section's check (the sections the config has); returns the config."""
    for name, check_section in SECTIONS.items():
        if name in config:
            check_section(config[name])
    return config
