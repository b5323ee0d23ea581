"""Golden shardings: every parameter's and optimizer-state leaf's PartitionSpec for a config on a topology, as JSON
checked in beside the tests, so a change of the logical-axis rules shows in review (MaxText keeps such files).

    python -m cfir_jax.aot.golden --config configs/large.py --topology v5p:4x4x4 \
        > tests/golden/large_v5p_4x4x4_shardings.json
"""

from __future__ import annotations

import argparse
import json

import jax

from cfir_jax.aot.topology import resolve
from cfir_jax.core.cli import load_config_file
from cfir_jax.training.state import make_setup


def sharding_table(config, topology_name: str) -> dict:
    """{"mesh": {axis: size}, "state": {path: spec}, "frozen": {path: spec}} of the train state on the topology."""
    topology = resolve(topology_name)
    setup = make_setup(config, total_steps=1000, devices=list(topology.devices), steps_per_epoch=100)

    def specs(tree) -> dict[str, str]:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(path, simple=True, separator="/"): str(tuple(s.spec)) for path, s in leaves}

    return {"topology": topology.name, "mesh": dict(setup.mesh.shape), "state": specs(setup.state_shardings),
            "frozen": specs(setup.frozen_shardings)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/large.py")
    parser.add_argument("--topology", default="v5p:4x4x4")
    args = parser.parse_args(argv)
    print(json.dumps(sharding_table(load_config_file(args.config), args.topology), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
