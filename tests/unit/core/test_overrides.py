"""Command-line overrides of a list field: a workdir's config comes from JSON, where every tuple of the config file is
a list, and config_flags refused a list with a traceback (UnsupportedOperationError). Each form is one line."""

import json

import pytest
from repo import ROOT

from cfir_jax.core import cli
from cfir_jax.core.errors import CfirError


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A workdir's index.json, as index.py records the config (JSON: tuples become lists)."""
    w = tmp_path_factory.mktemp("overrides")
    config = cli.load_config_file(str(ROOT / "configs/demo.py:tiny"))
    (w / "index.json").write_text(json.dumps({"config": json.loads(json.dumps(config.to_dict(), default=str))}))
    return w


@pytest.mark.parametrize("override, field, want", [
    ("--config.serve.methods=cfir,dense_summary", "serve.methods", ["cfir", "dense_summary"]),
    ("--config.serve.methods=[cfir, bm25]", "serve.methods", ["cfir", "bm25"]),
    ("--config.serve.methods=cfir", "serve.methods", ["cfir"]),
    ("--config.serve.methods=('cfir','bm25')", "serve.methods", ["cfir", "bm25"]),
    ("--config.retrieval.sr_buckets=64,512", "retrieval.sr_buckets", [64, 512]),
    ("--config.retrieval.sr_buckets=(8, 64)", "retrieval.sr_buckets", [8, 64]),
    ("--config.retrieval.sr_buckets=[128]", "retrieval.sr_buckets", [128]),
])
def test_a_list_field_of_a_workdirs_config_is_overridden_in_one_argument(recorded, override, field, want):
    config = cli.load("", recorded, [override, "--config.retrieval.top_k=7"])
    section, key = field.split(".")
    assert list(config[section][key]) == want
    assert type(config[section][key][0]) is type(want[0])
    assert config.retrieval.top_k == 7  # the other overrides still go through config_flags


def test_repeated_flags_add_items_as_for_a_tuple_of_a_config_file(recorded):
    from_workdir = cli.load("", recorded, ["--config.serve.methods=cfir", "--config.serve.methods=bm25"])
    from_file = cli.load(str(ROOT / "configs/demo.py:tiny"), None, ["--config.serve.methods=cfir",
                                                                   "--config.serve.methods=bm25"])
    assert list(from_workdir.serve.methods) == list(from_file.serve.methods) == ["cfir", "bm25"]


def test_an_ill_typed_item_is_one_line_naming_the_field_and_an_example(recorded):
    with pytest.raises(CfirError) as e:
        cli.load("", recorded, ["--config.retrieval.sr_buckets=small,large"])
    assert str(e.value) == ("--config.retrieval.sr_buckets=small,large: its items are ints, e.g. "
                            "--config.retrieval.sr_buckets=4096,16384,65536,262144")


def test_the_command_line_takes_a_list_override_of_a_workdir(recorded):
    """Through the command's own parser: one argument, no traceback."""
    args, config = cli.parse("x", argv=["--workdir", str(recorded), "--config.serve.methods=cfir,bm25"],
                             config_from_workdir=True)
    assert list(config.serve.methods) == ["cfir", "bm25"] and args.workdir == str(recorded)


def test_a_field_that_takes_any_value_is_left_to_config_flags(recorded):
    """train.trainable is a name or a rule list (a field of `object` type): a name stays a name; in a workdir's
    recorded config it is a list of rules, which takes a literal and refuses a bare name in one line."""
    from configs.base import get_config

    config = cli.apply_overrides(get_config("384"), ["--config.train.trainable=authors"])
    assert config.train.trainable == "authors"
    rules = cli.load("", recorded, ["--config.train.trainable=[['B/.*', 'train'], ['.*', 'frozen']]"])
    assert [list(rule) for rule in rules.train.trainable] == [["B/.*", "train"], [".*", "frozen"]]
    with pytest.raises(CfirError, match=r"^--config.train.trainable=authors: the field holds a list of lists"):
        cli.load("", recorded, ["--config.train.trainable=authors"])
