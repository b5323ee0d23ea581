"""BART-large-CNN's generation compiled for TPU slices (compile-only): memory per chip and FLOPs per decoding step.

    python benchmarks/bart_step_flops.py --topologies v5e-8,v6e-8,v5p-64 --dtype float32 --json OUT.json

For each slice, the summarizer's program (per host: a lone query, one row per chip, and the index's batch,
index.summaries.batch_size rows per chip) and its prefill alone (the encoder and every decoder layer's cross keys
and values, once per document). XLA's cost_analysis() counts a while loop's body once, so the FLOPs of one decoding
step are the program's minus the prefill's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cfir_jax.aot import programs as programs_lib  # noqa: E402
from cfir_jax.aot.compile import GIB  # noqa: E402
from cfir_jax.aot.topology import resolve  # noqa: E402
from cfir_jax.core.cli import load_config_file  # noqa: E402
from cfir_jax.nlp import summarizer as summarizer_lib  # noqa: E402


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost).get("flops", -1))


def prefill_program(model_name: str, dtype: str, mesh):
    graphdef, _, _ = summarizer_lib.abstract_bart(model_name, dtype)

    def prefill(state, ids, mask):
        model = nnx.merge(graphdef, state)
        return model.cross_keys_values(model.encode(ids, mask))

    return jax.jit(jax.shard_map(prefill, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P("data"),
                                 check_vma=False))


def row(topology_name: str, program, model_name: str, dtype: str) -> dict:
    topology = resolve(topology_name)
    start = time.perf_counter()
    compiled = program.lower().compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    mesh = jax.sharding.Mesh(list(topology.host_devices), ("data",))
    prefill = prefill_program(model_name, dtype, mesh).lower(*program.args).compile()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    out = {"topology": topology_name, "program": program.name, "shapes": program.shapes,
           "args_gib": m.argument_size_in_bytes / GIB, "temps_gib": m.temp_size_in_bytes / GIB,
           "total_gib": total / GIB,
           "flops_program": flops(compiled), "flops_prefill": flops(prefill), "compile_s": round(seconds, 1)}
    out["flops_step"] = out["flops_program"] - out["flops_prefill"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="v5e-8,v6e-8,v5p-64")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    config = load_config_file("configs/base.py")
    rows = [{"load_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}]
    for name in args.topologies.split(","):
        topology = resolve(name)
        programs = (programs_lib.bart_queries(config, topology, query_batches=(1,), dtypes=(args.dtype,))
                    + programs_lib.bart_index(config, topology, dtypes=(args.dtype,)))
        for program in programs:
            rows.append(row(name, program, config.index.summaries.bart_model, args.dtype))
            print(json.dumps(rows[-1]), flush=True)
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
