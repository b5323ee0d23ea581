"""index.json's version after a build (cfir_jax.index.runner._record_index): 1 after a first build, + 1 when a
rebuild built anything, kept when every stage was reused; the history of changes is kept."""

import json

from cfir_jax.index.runner import _record_index
from cfir_jax.index.stage_report import StageReport
from cfir_jax.stores.layout import Layout


def _reports(layout: Layout, reused: bool) -> list[StageReport]:
    return [StageReport("corpus", "3 docs", 0.1, layout.corpus, reused=True),
            StageReport("image_cache", "5 x 64", 0.2, layout.image_cache, reused=reused),
            StageReport("entity_index", "-", 0.0, layout.entity_index, stale_because="image_cache rebuilt")]


def test_builds_number_the_versions_and_keep_the_history(tmp_path, config):
    layout = Layout.of(tmp_path)
    _record_index(config, layout, _reports(layout, reused=False))
    first = json.loads(layout.index_json.read_text())
    assert first["version"] == 1 and [h["op"] for h in first["history"]] == ["build"]
    assert first["history"][0]["changes"] == {"stages": ["image_cache"]} and "stages" in first and "config" in first
    _record_index(config, layout, _reports(layout, reused=True))  # nothing built: the same version
    assert json.loads(layout.index_json.read_text())["history"] == first["history"]
    info = json.loads(layout.index_json.read_text())
    layout.index_json.write_text(json.dumps({**info, "version": 4, "history": [*info["history"], {"version": 4}]}))
    _record_index(config, layout, _reports(layout, reused=False))
    again = json.loads(layout.index_json.read_text())
    assert again["version"] == 5 and [h["version"] for h in again["history"]] == [1, 4, 5]
