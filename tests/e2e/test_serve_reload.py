"""The cluster's reload over the session's tiny index, in one process (no Ray): the command's Coordinator with its
real checks (`DiskWorkdir`), two shards whose replicas load versions by the real rule (`ShardVersions` over
`ShardSearch`, loading on a miss as Ray's multiplexing does), and a front (`FrontHolder`) whose Retrievers score on
them. A reload its checks refuse (a model of another family) never reaches the shards, and the served version keeps
answering; a good one is loaded by every shard before the front follows it, and the front then answers as one
process does; a replica started after a commit refuses the version the workdir no longer holds."""

import itertools
import json
import shutil

import pytest

from cfir_jax.cluster import command
from cfir_jax.cluster.follow import ShardVersions
from cfir_jax.cluster.front import FrontHolder
from cfir_jax.cluster.reload import Coordinator, Relay, Target, VersionGone
from cfir_jax.cluster.shard import LocalShards, ShardSearch, checked, committed_id
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.serve import resident
from cfir_jax.stores import lock, versions

OVERRIDES = ["--config.retrieval.sr=exact", "--config.entity_workers.serve=0", "--config.serve.max_batch=2"]
_changes = itertools.count()


def _commit(w) -> int:
    """A committed change of the workdir: a new version of the summaries (a note in its manifest), same answers."""
    with lock.hold(w, "test"):
        change = versions.begin(w, "add", {"test": next(_changes)})
        with change.stage("summaries") as tmp:
            shutil.copytree(w / "summaries", tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns("checksums.json"))
            manifest = json.loads((tmp / "manifest.json").read_text())
            (tmp / "manifest.json").write_text(json.dumps({**manifest, "note": f"v{next(_changes)}"}))
        return change.commit({"documents": 0})


class Replicas(LocalShards):
    """One replica per shard, in this process: the command's `Shards` (prepare) and the front's ShardClient, each
    version loaded by the real rule on its first call, as Ray's multiplexing loads it."""

    def __init__(self, w, shards: int = 2):
        config = resident.load_config(str(w), "", OVERRIDES)
        self.rules = [ShardVersions(lambda: committed_id(w),
                                    lambda vid, s=s: ShardSearch(config, str(w), s, shards, vid), f"shard {s}: ")
                      for s in range(shards)]
        self.held: list[dict] = [{} for _ in range(shards)]
        self.shards, self.prepared = shards, []

    def _at(self, s: int, vid: str) -> ShardSearch:
        if vid not in self.held[s]:
            self.held[s][vid] = self.rules[s].load(vid)
        return self.held[s][vid]

    def prepare(self, vid, timeout_s):
        self.prepared.append(vid)
        for s in range(self.shards):
            self._at(s, vid)

    def score(self, vid, fused, queries, parts):
        return {s: checked(s, vid, self._at(s, vid).score(fused, queries, p)) for s, p in parts.items()}

    def search(self, vid, queries, k, weights):
        return [checked(s, vid, self._at(s, vid).search(queries, k, weights)) for s in range(self.shards)]


@pytest.fixture
def copy(workdir, tmp_path):
    w = tmp_path / "W"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("train", "pretrain"))
    return w


def _hits(result):
    return [(h.id, h.score) for h in result.hits]


def test_a_refused_reload_never_reaches_the_shards_and_a_good_one_loads_them_before_the_front(copy, monkeypatch):
    w = copy
    config = resident.load_config(str(w), "", OVERRIDES)
    shards, relay = Replicas(w), Relay()
    target = Target(1, committed_id(w))
    front = FrontHolder(str(w), "", OVERRIDES, ["cfir"], 2, config, shards, target)
    coordinator = Coordinator(command.DiskWorkdir(str(w), "", OVERRIDES), shards, relay, target)
    doc = DocumentInput(Retriever(config, str(w)).corpus.document(0).text, "d")
    before = _hits(front.current.index.retrieve([doc], "cfir")[0])
    family = resident.model_family(w)
    monkeypatch.setattr(command, "model_family", lambda workdir: {**family, "num_layers": 99})
    for _ in range(2):
        _commit(w)
        outcome = coordinator.reload("SIGHUP")
        assert not outcome.ok and "another family (num_layers 2 -> 99)" in outcome.line, outcome.line
        assert shards.prepared == [] and [list(h) for h in shards.held] == [[target.vid]] * 2  # never asked
        assert _hits(front.current.index.retrieve([doc], "cfir")[0]) == before and front.target == target
    monkeypatch.setattr(command, "model_family", lambda workdir: family)
    outcome = coordinator.reload("SIGHUP")
    new = coordinator.target
    assert outcome.ok and new.version == 3 and relay.target() == new
    assert shards.prepared == [new.vid] and all(new.vid in h for h in shards.held)  # before the front follows
    fresh = front.follow(new)
    assert fresh.version == 3 and front.target == new
    alone = Retriever(config, str(w)).retrieve(doc)  # the pipeline's own answer
    assert _hits(fresh.index.retrieve([doc], "cfir")[0]) == [(h.image_id, h.score) for h in alone.hits]
    assert coordinator.reload("SIGHUP").line == "reload: version 3 is served already (SIGHUP)"


def test_a_replica_started_after_a_commit_refuses_the_version_gone_from_the_workdir(copy):
    w = copy
    served = committed_id(w)
    _commit(w)
    fresh = Replicas(w)
    with pytest.raises(VersionGone, match="shard 0: version 1 .* no longer in the workdir, which holds version 2"):
        fresh.search(served, [[0.0]], 1, (1.0, 0.0))
    assert fresh.rules[1].load(committed_id(w)).vid == committed_id(w)
