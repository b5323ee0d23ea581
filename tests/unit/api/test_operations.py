"""The config a library call runs with (`config_of`: a file, a ConfigDict, or the workdir's own, then keyword
overrides by name, checked) and the refusals that need no index, each one CfirError line as the commands print."""

import pytest
from repo import ROOT, TINY_CONFIG

from cfir_jax.api import operations
from cfir_jax.core.cli import load_config_file
from cfir_jax.core.errors import CfirError


def test_overrides_by_keyword_or_dotted_name_are_set_with_their_types():
    config = operations.config_of(str(ROOT / TINY_CONFIG), None, {"retrieval__top_k": 50, "retrieval.sr": "exact"})
    assert config.retrieval.top_k == 50 and config.retrieval.sr == "exact"
    assert config.is_locked


def test_a_config_dict_is_copied_not_changed():
    given = load_config_file(str(ROOT / TINY_CONFIG))
    before = given.retrieval.top_k
    operations.config_of(given, None, {"retrieval__top_k": before + 1})
    assert given.retrieval.top_k == before


@pytest.mark.parametrize("overrides, refusal", [
    ({"retrieval__nothing": 1}, r"^retrieval.nothing: unknown config field"),
    ({"nothing": 1}, r"^nothing: unknown config field"),
    ({"retrieval__top_k": "many"}, r"^retrieval.top_k='many': "),
    ({"retrieval__sr": "slow"}, r"retrieval.sr"),  # the section's own check (config_check), after the override
])
def test_a_wrong_override_is_one_line_naming_the_field(overrides, refusal):
    with pytest.raises(CfirError, match=refusal) as refused:
        operations.config_of(str(ROOT / TINY_CONFIG), None, overrides)
    assert "\n" not in str(refused.value)


def test_the_workdir_config_of_a_missing_workdir_is_the_commands_line(tmp_path):
    with pytest.raises(CfirError, match=r"no index here \(missing directory\); build it with index.py$"):
        operations.config_of(None, tmp_path / "none", {})
    with pytest.raises(CfirError, match="give a config"):
        operations.config_of(None, None, {})
    with pytest.raises(CfirError, match="expected a ConfigDict or a config file path, got int"):
        operations.config_of(3, None, {})


def test_verify_of_a_missing_workdir_and_of_an_empty_one(tmp_path):
    with pytest.raises(CfirError, match=r"none: no workdir here \(missing directory\)$"):
        operations.verify(tmp_path / "none")
    found = operations.verify(tmp_path)
    assert found.ok and found.intact == () and found.problems == ()
    assert operations.version(tmp_path) == 0
