"""A model directory's parameters read straight from orbax's files (cfir_jax.model.params_files): the same arrays as
orbax's restore, bit for bit, without orbax's import; orbax restores whatever that reader does not recognise."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from repo import ROOT

from cfir_jax.core.config import model_config
from cfir_jax.core.errors import StoreError
from cfir_jax.model import beit3, checkpoint, params_files

CFG = dict(embed_dim=64, num_heads=4, num_layers=2, ffn_dim=128, image_size=32, patch_size=16, vocab_size=300,
           max_text_positions=40)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = beit3.create_model(model_config("tiny", **CFG), seed=5)
    directory = tmp_path_factory.mktemp("model") / "m"
    checkpoint.save_model(model, directory)
    return model, directory


def _target(model):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0])), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_the_direct_read_is_orbax_s_restore_bit_for_bit(saved):
    import orbax.checkpoint as ocp

    model, directory = saved
    target = _target(model)
    direct = params_files.read(directory / "params", target)
    with ocp.StandardCheckpointer() as ckptr:
        by_orbax = ckptr.restore(directory / "params", target)
    pairs = list(zip(jax.tree.leaves(direct), jax.tree.leaves(by_orbax), strict=True))
    assert len(pairs) == len(jax.tree.leaves(target)) > 10
    for a, b in pairs:
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(direct) == jax.tree.structure(by_orbax)


def test_a_query_s_model_load_imports_no_orbax(saved):
    _, directory = saved
    code = ("import sys; from cfir_jax.model import checkpoint; m = checkpoint.load_model(sys.argv[1]); "
            "print(checkpoint.fingerprint(m, 'text'), 'orbax' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [checkpoint.read_model_manifest(directory)["text_fingerprint"], "False"]


def test_arrays_other_than_the_target_s_are_left_to_orbax(saved, tmp_path):
    model, directory = saved
    target = _target(model)
    other_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] + 1, *a.shape[1:]) if a.shape else (2,),
                                                              a.dtype, sharding=a.sharding), target)
    assert params_files.read(directory / "params", other_shape) is None
    other_dtype = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float16, sharding=a.sharding), target)
    assert params_files.read(directory / "params", other_dtype) is None
    fewer = {k: v for k, v in target.items() if k != "A"}
    assert params_files.read(directory / "params", fewer) is None
    assert params_files.read(tmp_path / "nothing", target) is None
    meta = json.loads((directory / "params" / "_METADATA").read_text())
    assert meta["use_ocdbt"] is True  # what orbax writes today, and the layout read


def test_damaged_parameters_are_still_orbax_s_one_line_error(saved, tmp_path):
    _, directory = saved
    damaged = tmp_path / "m"
    subprocess.run(["cp", "-a", str(directory), str(damaged)], check=True)
    for data in (damaged / "params").rglob("d/*"):
        data.write_bytes(b"not a chunk")
    assert params_files.read(damaged / "params", _target(saved[0])) is None
    with pytest.raises(StoreError, match="cannot read the model's parameters"):
        checkpoint.load_model(damaged)
