"""The compile-only command (cfir_jax/commands/compile_only.py): its refusals name the knob, or the missing flag."""

import sys

import pytest

from cfir_jax.aot.topology import libtpu_problem
from cfir_jax.commands import compile_only
from cfir_jax.core.cli import load_config_file
from cfir_jax.core.errors import CfirError

PROBLEM = libtpu_problem()
if PROBLEM:
    print(f"test_compile_only: skipped, libtpu unavailable: {PROBLEM}", file=sys.stderr)


def test_compile_only_needs_a_topology():
    with pytest.raises(CfirError, match="needs --topology"):
        compile_only.run("train", load_config_file("configs/base.py:runlocal"), "", out=lambda _: None)


@pytest.mark.skipif(bool(PROBLEM), reason=f"libtpu unavailable: {PROBLEM}")
def test_refusal_names_the_knob():
    config = load_config_file("configs/base.py:runlocal")
    with pytest.raises(CfirError, match=r"train_step does not fit v5e:2x2: .* GiB per device of 16 GiB .*"
                                        r"model\.remat=True"):
        compile_only.run("train", config, "v5e:2x2", out=lambda _: None, global_batch=1 << 20)
