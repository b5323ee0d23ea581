"""The cluster's reload protocol over the session's tiny index, in one process (no Ray): a front (ClusterHolder) and
the replicas of 2 shards (ShardReplica over ShardIndex) with the board. Two reloads the front itself refuses (a model
of another family) never reach the shards, and the version it serves keeps answering; a good reload then moves every
replica. Both engines, the Retriever and the front's ClusterRetriever, are the service's `Engine`. A shard opens all
its methods at one version even when a commit lands between two of them."""

import itertools
import json
import shutil
import threading
import time

import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.engine import Engine
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.serve import reload as protocol
from cfir_jax.serve import resident
from cfir_jax.serve.deployments import ClusterHolder
from cfir_jax.serve.reload import FrontReporter, ReloadBoard, ShardReplica
from cfir_jax.serve.shard import ShardIndex
from cfir_jax.stores import lock, versions

OVERRIDES = ["--config.retrieval.sr=exact", "--config.serve.entity_workers=0", "--config.serve.max_batch=2"]
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


@pytest.fixture
def copy(workdir, tmp_path):
    w = tmp_path / "W"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("train", "pretrain"))
    return w


class Replicas:
    """The front's client over in-process shard replicas: each call reaches one replica of each shard, in turn."""

    def __init__(self, replicas: list[list[ShardReplica]]):
        self.handles, self.turn = replicas, itertools.count()

    def _each(self):
        n = next(self.turn)
        return [replicas[n % len(replicas)] for replicas in self.handles]

    def score(self, version, method, docs, top_k):
        return [r.at(version).score(method, docs, top_k) for r in self._each()]

    def search(self, version, embeddings, k):
        return [r.at(version).search(embeddings, k) for r in self._each()]


def _hits(result):
    return [(h.image_id, h.score) for h in result.hits]


@pytest.mark.slow
def test_refused_reloads_never_reach_the_shards_and_the_served_version_keeps_answering(copy, monkeypatch):
    monkeypatch.setattr(protocol, "REPLICA_REPORT_S", 0.02)
    monkeypatch.setattr(protocol, "SETTLE_S", 0.0)
    w, board = copy, ReloadBoard()
    config = resident.load_config(str(w), "", OVERRIDES)
    replicas = [[ShardReplica(board, s, lambda s=s: ShardIndex(resident.load_config(str(w), "", OVERRIDES), str(w),
                                                               s, 2, ["cfir"]),
                              lambda: versions.current_version(w)) for _ in range(2)] for s in range(2)]
    holder = ClusterHolder(str(w), "", OVERRIDES, ["cfir"], 2, config, Replicas(replicas), board)
    front = FrontReporter(board, lambda: holder.current.version, holder.reload, grace_s=0, start=False)
    front.report()
    v1 = holder.current.version
    single = Retriever(config, str(w))
    assert isinstance(single, Engine) and isinstance(holder.current.retrievers["cfir"], Engine)  # one interface
    doc = DocumentInput(single.corpus.document(0).text, "d")
    before = [_hits(holder.current.retrievers["cfir"].retrieve(doc)) for _ in range(4)]  # every replica answers
    family = resident.model_family(w)
    monkeypatch.setattr(resident, "model_family", lambda workdir: {**family, "num_layers": 99})
    for _ in range(2):
        _commit(w)
        with pytest.raises(CfirError, match="another family"):
            holder.reload()
        front.report()
        time.sleep(0.2)
        assert [sorted(r.held) for rs in replicas for r in rs] == [[v1]] * 4  # the shards were never asked
    after = [_hits(holder.current.retrievers["cfir"].retrieve(doc)) for _ in range(4)]
    assert after == before and holder.current.version == v1
    monkeypatch.setattr(resident, "model_family", lambda workdir: family)
    fresh = holder.reload()
    assert fresh.version == v1 + 2
    assert all(fresh.version in r.held for rs in replicas for r in rs)  # every replica, before the swap
    assert _hits(fresh.retrievers["cfir"].retrieve(doc)) == before[0]
    front.report()
    deadline = time.monotonic() + 10
    while any(v1 in r.held for rs in replicas for r in rs):  # no front uses v1 any more: every replica drops it
        assert time.monotonic() < deadline, [sorted(r.held) for rs in replicas for r in rs]
        time.sleep(0.05)
    for r in (r for rs in replicas for r in rs):
        r.close()


@pytest.mark.slow
def test_a_shard_opens_every_method_at_one_version_when_a_commit_lands_between_them(copy, monkeypatch):
    w = copy
    config = resident.load_config(str(w), "", OVERRIDES)
    v = versions.current_version(w)
    real_init, committing = Retriever.__init__, []

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if not committing:  # after the first method's open: a commit, which has a second to land
            committing.append(threading.Thread(target=_commit, args=(w,)))
            committing[0].start()
            time.sleep(1.0)

    monkeypatch.setattr(Retriever, "__init__", init)
    shard = ShardIndex(config, str(w), 0, 2, ["cfir", "dense_summary"])
    committing[0].join(120)
    assert versions.current_version(w) == v + 1  # the commit landed, after the shard had opened its stores
    assert {m: r.stores.version for m, r in shard.retrievers.items()} == {"cfir": v, "dense_summary": v}
    assert shard.version == v
