"""The upgrade of an older workdir's config (cfir_jax/core/config_upgrade.py): sections and fields added since, and
fields moved (the old name refused as an override)."""

import json

import ml_collections
import pytest
from repo import ROOT, run_script

from cfir_jax.core import cli
from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.config_upgrade import MOVED, upgrade
from cfir_jax.core.config_workers import entity_workers_config
from cfir_jax.core.errors import CfirError
from cfir_jax.nlp.entity_workers import Settings


def test_older_workdir_configs_get_the_serve_section_and_new_fields():
    old = ml_collections.ConfigDict({"retrieval": {"top_k": 7}})
    upgrade(old)
    assert old.serve.to_dict() == serve_config().to_dict() and old.retrieval.top_k == 7
    assert "rerank" in old.retrieval and old.serve.host == "127.0.0.1"


# What a workdir built before the entity_workers section recorded (issue 52): the spaCy processes' settings in three
# sections, each set here to a value other than today's default so that its move shows.
OLD_FIELDS = {("serve", "entity_workers"): 4, ("serve", "entity_deadline_ms"): 2500.0,
              ("serve", "entity_max_restarts"): 7, ("serve", "entity_restart_window_s"): 30.0,
              ("retrieval", "entity_workers"): 3, ("retrieval", "entity_deadline_ms"): 90000.0}
NEW_FIELDS = {"serve": 4, "serve_deadline_ms": 2500.0, "max_restarts": 7, "restart_window_s": 30.0, "bulk": 3,
              "deadline_ms": 90000.0, "index": 2}


@pytest.fixture()
def old_workdir(tmp_path):
    config = cli.load_config_file(str(ROOT / "configs/demo.py:tiny")).to_dict()
    del config["entity_workers"]
    for (section, field), value in OLD_FIELDS.items():
        config[section][field] = value
    config["index"]["entities"]["n_process"] = 2
    (tmp_path / "index.json").write_text(json.dumps({"config": json.loads(json.dumps(config, default=str))}))
    return tmp_path


def test_a_workdir_recorded_with_the_old_keys_opens_with_its_values_under_the_new_ones(old_workdir):
    config = cli.load("", old_workdir)
    assert config.entity_workers.to_dict() == NEW_FIELDS
    assert not any(field in config[section] for section, field in OLD_FIELDS)
    assert "n_process" not in config.index.entities
    assert Settings.of(config, "serve") == Settings(4, 2.5, 7, 30.0)
    assert Settings.of(config, "bulk") == Settings(3, 90.0, 7, 30.0) and Settings.of(config, "query").workers == 1
    moved = {new for new in MOVED.values() if new.startswith("entity_workers.")}
    assert moved == {f"entity_workers.{k}" for k in entity_workers_config()}  # every field has a past


@pytest.mark.parametrize("old, new", sorted((o, n) for o, n in MOVED.items() if n.startswith("entity_workers.")))
def test_an_override_of_an_old_key_is_one_line_naming_the_new_one(old_workdir, old, new):
    with pytest.raises(CfirError) as e:
        cli.load("", old_workdir, [f"--config.{old}=1"])
    assert str(e.value) == f"--config.{old} has moved: use --config.{new} (the config's entity_workers section)"
    with pytest.raises(CfirError, match=f"^{old} has moved: use {new} "):  # the library's door (cfir_jax.open)
        cli.apply_values(cli.load("", old_workdir), {old.replace(".", "__"): 1})


def test_the_command_line_refuses_an_old_key_in_one_line_and_exit_2(old_workdir):
    proc = run_script("retrieve.py", "--index", str(old_workdir), "--query", "examples/doc.txt",
                      "--config.serve.entity_workers=4", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: --config.serve.entity_workers has moved: use "
                                                "--config.entity_workers.serve (the config's entity_workers section)"]


def test_the_image_queues_old_name_keeps_a_recorded_value_and_refuses_an_override(old_workdir):
    """serve.picture_queue_size became serve.image_queue_size (issue 58: one word for images): a workdir that
    recorded the old name keeps its value under the new one, and an override of the old name names the new."""
    recorded = json.loads((old_workdir / "index.json").read_text())
    recorded["config"]["serve"]["picture_queue_size"] = 5
    del recorded["config"]["serve"]["image_queue_size"]
    (old_workdir / "index.json").write_text(json.dumps(recorded))
    config = cli.load("", old_workdir)
    assert config.serve.image_queue_size == 5 and "picture_queue_size" not in config.serve
    with pytest.raises(CfirError) as e:
        cli.load("", old_workdir, ["--config.serve.picture_queue_size=2"])
    assert str(e.value) == ("--config.serve.picture_queue_size has moved: use --config.serve.image_queue_size "
                            "(one word for images, issue 58)")
