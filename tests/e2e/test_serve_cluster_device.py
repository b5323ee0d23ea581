"""The Ray engine with SR on the device, forced on the CPU (JAX's CPU is a device): `retrieve.py --serve --engine
ray --config.retrieval.sr_backend=device`, 2 shards, from an empty HOME. It starts (every shard replica compiles its
device programs before Ray sends it a request), warms and answers as the CPU backend does: the same hits in the same
order, scores within 1e-5 (tests/e2e/test_serve_shards.py: the front makes no copy of the cache, its shards do)."""

import json

import pytest
from repo import run_script

pytest.importorskip("ray.serve", reason="the cluster service needs Ray Serve: pip install -e '.[cluster]'")


@pytest.mark.slow
def test_sr_on_the_device_starts_warms_and_answers_as_the_cpu(workdir, documents, tmp_path):
    # why: the cluster tests' command runner imports Ray's helpers
    from test_serve_cluster import Cluster

    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in documents))
    proc = run_script("retrieve.py", "--index", str(workdir), "--queries", str(queries), "--format", "json",
                      "--config.retrieval.sr=exact", "--config.retrieval.sr_backend=cpu")
    expected = {a["id"]: a for a in map(json.loads, proc.stdout.splitlines())}
    cluster = Cluster(workdir, tmp_path / "home", "--config.serve.shards=2", "--config.retrieval.sr_backend=device")
    try:
        for doc_id, text in documents:
            r = cluster.search(text, id=doc_id)  # the 20 hits retrieve.py shows
            assert r.status_code == 200, r.text
            got, want = r.json()["hits"], expected[doc_id]["hits"]
            assert [h["image_id"] for h in got] == [h["image_id"] for h in want], doc_id
            assert [h["score"] for h in got] == pytest.approx([h["score"] for h in want], abs=1e-5)
        assert cluster.client.get("/readyz").json()["shards"] == {"0": "ok", "1": "ok"}
    finally:
        code, log = cluster.stop()
    assert code == 0 and "Traceback" not in log, log[-3000:]
