"""The shipped configs carry CFIR's training recipe, and the trainer uses it (warmup in epochs, llrd, drop path)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_fixtures import planted_data, tiny_config

import configs.base
import configs.large
from cfir_jax.model import beit3 as model_lib
from cfir_jax.training import loop
from cfir_jax.training.optim import make_schedule, warmup_steps
from cfir_jax.training.state import make_setup
from cfir_jax.training.tasks import TextTask

RECIPE_ROW = re.compile(r"^\s+((?:model|train)\.\w+)\s+([0-9][-+0-9.e]*)\s+\S")


def _recipe_table() -> dict[str, float]:
    """{key: value} of the recipe table in configs/base.py's docstring."""
    rows = [RECIPE_ROW.match(line) for line in configs.base.__doc__.splitlines()]
    return {m.group(1): float(m.group(2)) for m in rows if m}


@pytest.mark.parametrize("module", [configs.base, configs.large], ids=["base", "large"])
def test_recipe_table_of_the_docstring_is_what_the_config_sets(module):
    table = _recipe_table()
    assert len(table) == 14 and table["model.drop_path_rate"] == 0.1 and table["train.layer_decay"] == 0.9
    cfg = module.get_config()
    for key, value in table.items():
        section, field = key.split(".")
        assert float(cfg[section][field]) == pytest.approx(value), key
    assert cfg.train.warmup_steps == 0  # the warmup is the recipe's 5 epochs, not a fixed step count


@pytest.mark.parametrize("module", [configs.base, configs.large], ids=["base", "large"])
def test_model_of_the_config_has_drop_path_0_1_over_the_layers_and_no_dropout(module):
    cfg = module.get_config()
    model = model_lib.abstract_model(cfg.model)
    layers = cfg.model.num_layers
    for expert in (model.A, model.B):
        np.testing.assert_allclose(expert.drop_path_rates, np.linspace(0.0, 0.1, layers))
        assert expert.dropout == 0.0


# The authors' documented stage-2 command (their README), where it differs from the paper's values: 128 per GPU on
# the README's 4 GPUs is the global 512; --tune_text_only's trainable set; no --randaug.
AUTHORS_COMMAND = {"train.lr": 2e-4, "train.global_batch": 512, "train.trainable": "authors", "train.randaug": False,
                   "train.warmup_epochs": 3.0, "train.layer_decay": 0.65,
                   "model.drop_path_rate": 0.2, "train.weight_decay": 0.05, "train.num_epochs": 30.0,
                   "train.max_text_len": 64}


@pytest.mark.parametrize("module", [configs.base, configs.large], ids=["base", "large"])
def test_authors_variant_is_their_stage_2_command_and_changes_nothing_else(module):
    paper, authors = module.get_config(), module.get_config("authors")
    for key, value in AUTHORS_COMMAND.items():
        section, field = key.split(".")
        assert authors[section][field] == (pytest.approx(value) if isinstance(value, float) else value), key
    changed = {f"{s}.{f}" for s in ("model", "train", "index", "retrieval") for f in paper[s]
               if paper[s][f] != authors[s][f]}
    assert changed == {"train.lr", "train.warmup_epochs", "train.layer_decay", "model.drop_path_rate",
                       "train.trainable", "train.randaug"}  # global_batch: 4 x 128 is the paper's 512
    # The model of the variant drops paths up to 0.2; the warmup is 3 epochs of steps at batch 512.
    model = model_lib.abstract_model(authors.model)
    np.testing.assert_allclose(model.B.drop_path_rates, np.linspace(0.0, 0.2, authors.model.num_layers))
    spe = planted_data(num_pairs=10 * 512, with_eval=False).steps_per_epoch(authors.train.global_batch)
    assert warmup_steps(authors.train, spe) == 30
    assert module.get_config("authors,384").model.image_size == 384


def test_warmup_of_5_epochs_is_5_epochs_of_steps_for_the_dataset_size():
    cfg = configs.base.get_config().train
    pairs = 20 * 512 + 100  # 20 full batches of 512 per epoch (the tail is dropped)
    spe = planted_data(num_pairs=pairs, with_eval=False).steps_per_epoch(cfg.global_batch)
    assert spe == 20 and warmup_steps(cfg, spe) == 100
    schedule = make_schedule(cfg, total_steps=30 * spe, steps_per_epoch=spe)
    assert float(schedule(50)) == pytest.approx(0.5 * cfg.lr)
    assert float(schedule(100)) == pytest.approx(cfg.lr)
    assert float(schedule(99)) < cfg.lr
    with pytest.raises(ValueError, match="steps_per_epoch"):
        warmup_steps(cfg, None)


def test_trainer_warms_up_over_epochs_of_its_data(tmp_path):
    """64 pairs at batch 8 = 8 steps per epoch; warmup_epochs=0.5 -> the logged lr climbs over 4 steps."""
    cfg = tiny_config(num_steps=6, warmup_steps=0, warmup_epochs=0.5, checkpoint_every=100, eval_every=100)
    loop.run(cfg, tmp_path, TextTask(planted_data(num_pairs=64, with_eval=False)))
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(lrs[:5], [cfg.train.lr * s / 4 for s in range(5)], rtol=1e-6)
    assert lrs[5] < cfg.train.lr


def test_optimizer_of_the_config_scales_layer_i_by_0_9_to_the_depth_above_it():
    """Under llrd 0.9, layer i (0-based) of L moves 0.9 ** (L - i) as far as the head; the position table
    (layer 0 of the reference's numbering) 0.9 ** (L + 1)."""
    cfg = tiny_config(warmup_steps=1)  # configs/base.py:runlocal: the recipe's layer_decay on a 2-layer model
    assert cfg.train.layer_decay == 0.9
    setup = make_setup(cfg, total_steps=10)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), setup.abstract_params)  # zeros: no decay term
    grads = jax.tree.map(jnp.ones_like, params)
    opt_state = setup.tx.init(params)
    for _ in range(2):  # step 0 has lr 0 (warmup from 0); step 1 the full lr
        updates, opt_state = setup.tx.update(grads, opt_state, params)
    head = float(np.abs(updates["language_head"]["kernel"]).mean())
    assert head > 0
    layers = cfg.model.num_layers
    fc1 = np.abs(np.asarray(updates["B"]["layers"]["fc1"]["kernel"]))
    for i in range(layers):
        assert fc1[i].mean() / head == pytest.approx(0.9 ** (layers - i), rel=1e-4), i
    positions = float(np.abs(updates["B"]["embed_positions"]).mean())
    assert positions / head == pytest.approx(0.9 ** (layers + 1), rel=1e-4)


def test_image_text_fields_of_the_config_are_atomics_caption_columns():
    from cfir_jax.core.config import IMAGE_TEXT_FIELDS
    from cfir_jax.data.atomic import CAPTION_FIELDS

    assert IMAGE_TEXT_FIELDS == tuple(CAPTION_FIELDS)


def test_upgrade_fills_what_an_older_workdir_lacks_and_changes_nothing_it_has(tmp_path):
    """A recorded config from before fusion, rerank and the SR backend existed reads with their current defaults, in
    one place (cli.workdir_config); what it recorded stays; a current config is left as it is."""
    import json

    from cfir_jax.core.cli import workdir_config
    from cfir_jax.core.config import index_config, retrieval_config
    from cfir_jax.core.config_upgrade import upgrade
    from configs.demo import get_config

    current = get_config("tiny")
    old = current.to_dict()
    for key in ("fusion", "rerank", "sr_backend", "sr", "entity_text_match", "batch_size"):
        del old["retrieval"][key]
    del old["index"]["image_text"]
    del old["index"]["entities"]["sources"]
    old["retrieval"]["top_k"] = 77
    (tmp_path / "index.json").write_text(json.dumps({"config": old}, default=str))
    config = workdir_config(tmp_path)
    defaults = retrieval_config()
    assert config.retrieval.fusion.to_dict() == defaults.fusion.to_dict()
    assert config.retrieval.rerank.to_dict() == defaults.rerank.to_dict()
    assert config.retrieval.sr_backend == "auto" and config.retrieval.batch_size == defaults.batch_size
    assert config.retrieval.sr == "fast"  # what a workdir without the field meant: the fast scorer
    assert config.retrieval.entity_text_match is False
    assert config.index.entities.sources == "spacy"  # a workdir of before the choice: spaCy's entities alone
    # the section's defaults, not the experiment's choices (an index built before the stage existed has none)
    assert config.index.image_text.to_dict() == index_config(bool(current.runlocal)).image_text.to_dict()
    assert config.retrieval.top_k == 77  # recorded: kept
    again = upgrade(config.copy_and_resolve_references())
    assert again.to_dict() == config.to_dict()
    assert upgrade(current.copy_and_resolve_references()).to_dict() == current.to_dict()


FULL_CHANGES = {"train.trainable": "full", "train.images": "pixels", "train.text": "document", "model.remat": True,
                "model.remat_policy": "nothing", "model.dtype": "bfloat16"}


@pytest.mark.parametrize("module", [configs.base, configs.large], ids=["base", "large"])
def test_full_variant_is_the_whole_model_from_pixels_and_changes_nothing_else(module):
    paper, full = module.get_config(), module.get_config("full")
    changed = {f"{s}.{f}" for s in ("model", "train", "index", "retrieval", "mesh") for f in paper[s]
               if paper[s][f] != full[s][f]}
    # Both sizes rematerialise already; base keeps its matmuls' outputs (large does not), the Full step neither.
    assert changed == set(FULL_CHANGES) - ({"model.remat", "model.remat_policy"} if module is configs.large
                                           else {"model.remat"})
    for key, value in FULL_CHANGES.items():
        section, field = key.split(".")
        assert full[section][field] == value, key
    assert full.model.image_size == 224 and full.train.document_fields == (
        "page_title", "section_title", "context_section_description")
    # Everything retrieval uses trains; BEiT-3's masked-image-modelling token alone stays (no gradient reaches it).
    setup = make_setup(full, total_steps=10, devices=jax.devices()[:1], steps_per_epoch=10)
    assert setup.tower == "dual"
    frozen = [model_lib.param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(setup.abstract_frozen)[0]]
    assert frozen == ["vision_embed/mask_token"]
    trained = sum(a.size for a in jax.tree.leaves(setup.abstract_params))
    # At 224 px: the 384 px model (REFERENCE: 222,458,881 base, 675,188,737 large) less 380 vision positions and the
    # mask token, of D (768, 1024) each
    assert trained == {configs.base: 222_166_273, configs.large: 674_798_593}[module]
