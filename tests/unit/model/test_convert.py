"""Conversion of official-layout PyTorch checkpoints: CLI round trip, validation errors, position interpolation."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from repo import ROOT
from torch_reference import random_reference, state_dict_numpy

from cfir_jax.core.config import model_config
from cfir_jax.model import checkpoint
from cfir_jax.model.convert import CheckpointError, bicubic_resize, load_torch_checkpoint

CFG = dict(embed_dim=64, num_heads=4, num_layers=2, ffn_dim=128, image_size=32, patch_size=16,
           vocab_size=300, max_text_positions=40)


def _cfg(**kw):
    return model_config("tiny", **{**CFG, **kw})


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (2, 9)).astype(np.int32)
    ids[:, 0], ids[1, 5:] = 0, 1
    return ids, ids == 1, rng.uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def reference():
    return random_reference(_cfg(), seed=3)


def test_state_dict_layouts_give_the_same_model(reference):
    sd = state_dict_numpy(reference)
    ids, mask, _ = _batch()
    want = np.asarray(load_torch_checkpoint(sd, _cfg()).encode_text(ids, mask))
    for variant in ({"model": sd}, {"module": sd}, {k.removeprefix("beit3."): v for k, v in sd.items()}):
        np.testing.assert_array_equal(np.asarray(load_torch_checkpoint(variant, _cfg()).encode_text(ids, mask)), want)


def test_cli_round_trip_through_orbax(reference, tmp_path):
    pth = tmp_path / "beit3_tiny.pth"
    torch.save({"model": reference.state_dict()}, pth)
    config = tmp_path / "tiny_config.py"
    config.write_text(
        "from configs.base import experiment\n"
        "def get_config(arg=None):\n"
        "    cfg = experiment('base', 'runlocal')\n"
        f"    cfg.model.update({CFG!r})\n"
        "    return cfg\n"
    )
    out = tmp_path / "model"
    proc = subprocess.run([sys.executable, "-m", "cfir_jax.model.convert", "--checkpoint", str(pth), "--config",
                           str(config), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    restored = checkpoint.load_model(out)
    ids, mask, pixels = _batch()
    with torch.no_grad():
        want_t, _ = reference.encode_text(torch.from_numpy(ids).long(), torch.from_numpy(mask))
        want_i, _ = reference.encode_image(torch.from_numpy(pixels).permute(0, 3, 1, 2))
    np.testing.assert_allclose(np.asarray(restored.encode_text(ids, mask)), want_t.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(restored.encode_image(pixels)), want_i.numpy(), atol=1e-5)


def test_cli_bad_checkpoint_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    proc = subprocess.run([sys.executable, "-m", "cfir_jax.model.convert", "--checkpoint", str(bad), "--config",
                           "configs/base.py:runlocal", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not a readable PyTorch checkpoint" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_wrong_size_names_key_and_shapes(reference):
    with pytest.raises(CheckpointError, match=r"text_embed.weight.*\(300, 64\).*\(300, 96\)"):
        load_torch_checkpoint(state_dict_numpy(reference), _cfg(embed_dim=96, num_heads=4))
    with pytest.raises(CheckpointError, match="2 encoder layers but the config has 3"):
        load_torch_checkpoint(state_dict_numpy(reference), _cfg(num_layers=3))


def test_missing_and_unexpected_keys(reference):
    sd = state_dict_numpy(reference)
    broken = {k: v for k, v in sd.items() if k != "beit3.encoder.layers.1.ffn.B.fc2.bias"}
    with pytest.raises(CheckpointError, match="encoder.layers.1.ffn.B.fc2.bias"):
        load_torch_checkpoint(broken, _cfg())
    with pytest.raises(CheckpointError, match="mlm_head.weight"):
        load_torch_checkpoint({**sd, "mlm_head.weight": np.zeros(3)}, _cfg())
    headless = {k: v for k, v in sd.items() if "head" not in k and k != "logit_scale"}
    with pytest.raises(CheckpointError, match="no retrieval heads"):
        load_torch_checkpoint(headless, _cfg())
    load_torch_checkpoint(headless, _cfg(), allow_missing_heads=True)


def test_bicubic_resize_matches_torch_interpolate():
    grid = np.random.default_rng(0).normal(size=(14, 14, 8)).astype(np.float32)
    for size in (24, 7, 14, 20):
        want = torch.nn.functional.interpolate(torch.from_numpy(grid).permute(2, 0, 1)[None], size=(size, size),
                                               mode="bicubic", align_corners=False)[0].permute(1, 2, 0).numpy()
        np.testing.assert_allclose(bicubic_resize(grid, size), want, atol=1e-5)


def test_position_table_is_interpolated_to_the_configured_image_size(reference):
    """A 32 px (2x2 grid) checkpoint loaded at 64 px (4x4): first 3 rows kept, grid resized bicubically."""
    sd = state_dict_numpy(reference)
    model = load_torch_checkpoint(sd, _cfg(image_size=64))
    table = sd["beit3.encoder.embed_positions.A.weight"]
    got = np.asarray(model.A.embed_positions[...])
    assert got.shape == (3 + 16, 64)
    np.testing.assert_array_equal(got[:3], table[:3])
    want = torch.nn.functional.interpolate(torch.from_numpy(table[3:].reshape(1, 2, 2, 64)).permute(0, 3, 1, 2),
                                           size=(4, 4), mode="bicubic", align_corners=False)
    np.testing.assert_allclose(got[3:], want.permute(0, 2, 3, 1).reshape(16, 64).numpy(), atol=1e-5)
