"""index.encoder naming another workdir: its recorded encoder, its trained model and its corpus' tokenizer."""

import json

import ml_collections
import pytest

from cfir_jax.builders.index_encoder import encoder_dir, encoder_tokenizer, other_model
from cfir_jax.core.errors import CfirError
from cfir_jax.stores.layout import Layout


def _config(encoder: str, tokenizer: str = "") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"tokenizer": tokenizer, "index": {"encoder": encoder}})


@pytest.fixture
def other(tmp_path):
    w = tmp_path / "other"
    for model in ("encoder", "model"):
        (w / model).mkdir(parents=True)
        (w / model / "manifest.json").write_text(json.dumps({"vision_fingerprint": "v", "text_fingerprint": model}))
    (w / "corpus").mkdir()
    (w / "corpus" / "tokenizer.spm").write_bytes(b"spm")
    (w / "index.json").write_text(json.dumps({"encoder": "encoder", "stages": []}))
    return w


def test_a_workdir_gives_its_recorded_encoder_model_and_tokenizer(other, tmp_path):
    layout = Layout.of(tmp_path / "mine")
    config = _config(str(other))
    assert encoder_dir(config, layout) == other / "encoder"
    assert other_model(config) == other / "model"
    assert encoder_tokenizer(config) == other / "corpus" / "tokenizer.spm"
    assert encoder_tokenizer(_config(str(other), tokenizer="beit3.spm")) is None  # the config's tokenizer wins


def test_a_model_directory_stays_itself(other, tmp_path):
    config = _config(str(other / "encoder"))
    assert encoder_dir(config, Layout.of(tmp_path / "mine")) == other / "encoder"
    assert other_model(config) is None and encoder_tokenizer(config) is None


def test_a_workdir_without_a_trained_model_gives_none(other):
    (other / "model" / "manifest.json").unlink()
    assert other_model(_config(str(other))) is None


def test_an_unreadable_index_json_of_the_other_workdir_is_one_line(other, tmp_path):
    (other / "index.json").write_text("{not json")
    with pytest.raises(CfirError, match=r"other/index\.json: unreadable; finish that workdir's index\.py run"):
        encoder_dir(_config(str(other)), Layout.of(tmp_path / "mine"))
