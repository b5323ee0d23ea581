"""The upgrade of an older workdir's config (cfir_jax/core/config_upgrade.py): sections and fields added since."""

import ml_collections

from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.config_upgrade import upgrade


def test_older_workdir_configs_get_the_serve_section_and_new_fields():
    old = ml_collections.ConfigDict({"retrieval": {"top_k": 7}})
    upgrade(old)
    assert old.serve.to_dict() == serve_config().to_dict() and old.retrieval.top_k == 7
    assert "rerank" in old.retrieval and old.serve.host == "127.0.0.1"
