"""Compile-only (cfir_jax/aot): the train step and the device SR compiled for a small TPU topology with libtpu's
compiler (no TPU attached), per-device memory read from the executable, refusals that name the knob, and the large
config's golden shardings on a 64-chip slice."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from repo import ROOT

from cfir_jax.aot import programs as programs_lib
from cfir_jax.aot.compile import compile_program
from cfir_jax.aot.topology import libtpu_problem, resolve
from cfir_jax.core.cli import load_config_file
from cfir_jax.core.errors import CfirError

GOLDEN = ROOT / "tests" / "golden" / "large_v5p_4x4x4_shardings.json"
PROBLEM = libtpu_problem()
if PROBLEM:
    print(f"test_compile_only: skipped, libtpu unavailable: {PROBLEM}", file=sys.stderr)
pytestmark = pytest.mark.skipif(bool(PROBLEM), reason=f"libtpu unavailable: {PROBLEM}")


def _per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of abstract arrays with shardings (shard shape x itemsize)."""
    leaves = jax.tree.leaves(abstract_tree)
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in leaves)


def test_topologies_resolve_with_hosts_and_hbm():
    t = resolve("v5p-64")
    assert (t.name, t.chips, len(t.devices), t.hosts, len(t.host_devices)) == ("v5p:4x4x4", 64, 64, 16, 4)
    assert t.hbm_bytes == 95 * 2**30
    assert resolve("v5e:2x4").hosts == 1 and resolve("v5e:4x4").hosts == 4
    with pytest.raises(CfirError, match="GENERATION:GRID"):
        resolve("v9:2x2")
    with pytest.raises(CfirError, match="integers"):
        resolve("v5e:axb")


def test_tiny_train_step_compiles_with_the_state_it_shards():
    config = load_config_file("configs/base.py:runlocal")
    topology = resolve("v5e:2x2")
    step, encoder = programs_lib.train_step(config, topology)
    result = compile_program(step, topology)
    assert result.fits and result.compile_s > 0
    # The donated state comes back in place: outputs alias the state's bytes.
    state, frozen, batch = step.args
    expected = _per_device_bytes((state, frozen, batch))
    # What the compiler says each device holds = the sharded arguments (tile padding of tiny arrays at most 10%).
    assert expected <= result.arguments <= 1.1 * expected + 65536
    assert result.aliased >= 0.9 * _per_device_bytes(state)
    assert compile_program(encoder, topology).fits


@pytest.mark.slow
def test_base_train_step_compiles_data_parallel_with_replicated_state():
    """Base at the paper's 87M trained parameters: replicated state (no FSDP), batch split over the 4 chips."""
    config = load_config_file("configs/base.py")
    topology = resolve("v5e:2x2")
    step = programs_lib.train_step(config, topology, global_batch=64)[0]
    result = compile_program(step, topology)
    state, frozen, batch = step.args
    # Replicated: every device holds every parameter and both Adam moments.
    full = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state["params"]))
    assert _per_device_bytes(state["params"]) == full
    assert result.arguments >= 3 * full  # params + mu + nu
    assert result.fits and result.total < 16 * 2**30


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_device_sr_is_row_sharded_and_its_temporaries_do_not_grow_with_the_cache():
    config = load_config_file("configs/base.py:runlocal")
    config.unlock()
    config.model.embed_dim = 128  # a multiple of TPU's 128-lane tiles, as 768 and 1024
    topology = resolve("v5e:2x2")
    memory = {}
    for n in (200_000, 400_000):
        program = programs_lib.device_sr(config, topology, n, "bfloat16", query_batches=(8,))[0]
        memory[n] = program.lower().compile().memory_analysis()
    for n, m in memory.items():
        shard = n // 4 * 128 * 2  # the cache is never gathered onto one chip: each holds its quarter of the rows
        replicated = 8 * programs_lib.UNION_BUCKET * 4 + 8 * 128 * 4  # the union ids and the queries
        assert shard <= m.argument_size_in_bytes <= shard + replicated + 65536
    assert memory[400_000].temp_size_in_bytes == memory[200_000].temp_size_in_bytes


def test_the_filtered_search_is_row_sharded_and_reads_only_its_shards_passing_rows():
    """A filter's whole-cache search (10% passing) on v5e 2x2: each chip holds its quarter of the cache and the ids
    of its own passing rows, never the whole cache nor every shard's ids."""
    config = load_config_file("configs/base.py:runlocal")
    config.unlock()
    config.model.embed_dim = 128
    n = 400_000
    program = programs_lib.filtered_search(config, resolve("v5e:2x2"), n, "bfloat16")[0]
    m = program.lower().compile().memory_analysis()
    shard, ids = n // 4 * 128 * 2, 32768 * 4  # a quarter of the rows; its 10,000 passing rows: one 32,768 block
    assert shard + ids <= m.argument_size_in_bytes <= shard + ids + 65536


def test_train_cli_compile_only_reads_no_workdir():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "train.py", "--config", "configs/base.py:runlocal", "--compile-only",
                          "--topology", "v5e:2x2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr == "", out.stderr[-2000:]  # libtpu's failed cloud-metadata probes are held back
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.strip()}
    assert lines["train_step"][6] == "yes" and lines["eval_encoder"][6] == "yes"
    bad = subprocess.run([sys.executable, "train.py", "--config", "configs/base.py:runlocal", "--compile-only",
                          "--topology", "v7x:2x2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "GENERATION:GRID" in bad.stderr


def test_large_shardings_match_the_golden_file():
    """Regenerate after an intended change of the rules: python -m cfir_jax.aot.golden > tests/golden/..."""
    from cfir_jax.aot.golden import sharding_table

    table = sharding_table(load_config_file("configs/large.py"), "v5p:4x4x4")
    golden = json.loads(GOLDEN.read_text())
    changed = {k: (golden["state"].get(k), v) for k, v in table["state"].items() if golden["state"].get(k) != v}
    assert not changed and table == golden, f"shardings changed (golden, now): {changed}"
    # FSDP over the 64 chips shards every large trained kernel and both Adam moments.
    kernels = [k for k in table["state"] if k.endswith("kernel")]
    assert kernels and all("fsdp" in table["state"][k] for k in kernels)


def test_retrieve_compile_only_needs_a_config_and_index_needs_no_workdir():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "retrieve.py", "--compile-only", "--topology", "v5e:2x2"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--compile-only needs --config" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "index.py", "--config", "configs/base.py:runlocal"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--workdir" in out.stderr  # without --compile-only the workdir is required


@pytest.mark.slow  # 37 s at load 12 (one compile of beam search)
def test_bart_generation_compiles_data_parallel_for_a_small_topology(tmp_path):
    """The summarizer's beam search (a tiny BART's architecture, no weights) per host of v5e 2x2: parameters
    replicated on each chip, the rows split over the 4 chips, a lone query padded to one row per chip."""
    from transformers import BartConfig

    BartConfig(vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=128,
               forced_bos_token_id=0, forced_eos_token_id=2).save_pretrained(tmp_path)
    config = load_config_file("configs/base.py:runlocal")
    config.unlock()
    config.index.summaries.bart_model = str(tmp_path)
    topology = resolve("v5e:2x2")
    queries = programs_lib.bart_queries(config, topology, query_batches=(1, 8), dtypes=("float32",))
    assert [p.name for p in queries] == ["bart_q1_f32", "bart_q8_f32"]
    # 1,024 input tokens asked, the model's 128 positions held; q1 is 4 rows (one per chip), q8 two per chip.
    assert [p.args[1].shape for p in queries] == [(4, 128), (8, 128)]
    assert queries[1].args[1].sharding.shard_shape((8, 128)) == (2, 128)
    assert all(a.sharding.shard_shape(a.shape) == a.shape for a in jax.tree.leaves(queries[1].args[0]))
    result = compile_program(queries[1], topology)
    assert result.fits and result.per_host and result.arguments > 0 and result.temporaries > 0
    index = programs_lib.bart_index(config, topology, dtypes=("bfloat16",))
    assert [p.name for p in index] == ["bart_index_bf16"] and index[0].args[1].shape == (4 * 8, 128)
    config.index.summaries.summarizer = "extractive"  # no BART run: no BART program
    assert programs_lib.bart_queries(config, topology) == [] and programs_lib.bart_index(config, topology) == []
