"""SR on the device, as a user with a GPU or TPU meets it (`retrieval.sr_backend="auto"` picks the device there), forced
on this CPU (JAX's CPU is a device: the jitted device programs run on it): `retrieve.py --query`, `--queries`,
`--query-image-id`, `--evaluate test`, the single-process `--serve` and `cfir_jax.open(W)` each start, warm up and
answer as the CPU backend does (ids equal, scores within 1e-5). `--serve` with the device backend died at warm-up
(AttributeError: 'Retriever' object has no attribute 'sr_rows')."""

import json
import os
import signal
import subprocess

import command_server
import httpx
import numpy as np
import pytest
from repo import ROOT, run_script
from serving import wait_ready

import cfir_jax

DEVICE, CPU = "--config.retrieval.sr_backend=device", "--config.retrieval.sr_backend=cpu"


def _same_hits(got: list, want: list, ids: str = "image_id") -> None:
    assert [h[ids] for h in got] == [h[ids] for h in want]
    np.testing.assert_allclose([h["score"] for h in got], [h["score"] for h in want], rtol=0, atol=1e-5)


def _same_answer(got: dict, want: dict) -> None:
    _same_hits(got["hits"], want["hits"])
    for key in ("entities", "unknown_entities", "summary", "note", "num_candidates"):
        assert got[key] == want[key], key
    assert [h["entities"] for h in got["hits"]] == [h["entities"] for h in want["hits"]]


def _json_lines(*args: str) -> dict:
    proc = run_script("retrieve.py", *args, "--format", "json")
    return {a["id"]: a for a in map(json.loads, proc.stdout.splitlines())}


def _run_file(path) -> dict:
    run = {}
    for line in path.read_text().splitlines():
        doc, _, image, rank, score, _ = line.split()
        run.setdefault(doc, []).append({"image_id": image, "rank": int(rank), "score": float(score)})
    return run


@pytest.fixture(scope="module")
def queries(workdir, documents, tmp_path_factory):
    """The session's documents as a queries file (three with entities, one without) and the first as a query file."""
    folder = tmp_path_factory.mktemp("device_sr")
    (folder / "q.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in documents))
    (folder / "doc.txt").write_text(documents[0][1])
    return folder


@pytest.mark.slow  # a dozen commands and a service on the tiny world (~1 min on 2 cores)
def test_every_door_with_sr_on_the_device_answers_as_the_cpu_backend(workdir, documents, queries, tmp_path):
    w = str(workdir)
    # --queries and --query
    cpu = _json_lines("--index", w, "--queries", str(queries / "q.jsonl"), CPU)
    device = _json_lines("--index", w, "--queries", str(queries / "q.jsonl"), DEVICE)
    assert set(device) == set(cpu) == {i for i, _ in documents}
    for doc_id in cpu:
        _same_answer(device[doc_id], cpu[doc_id])
    assert cpu["no-entity"]["note"] and cpu[documents[0][0]]["hits"][0]["entities"]  # both paths compared
    one = _json_lines("--index", w, "--query", str(queries / "doc.txt"), DEVICE)
    _same_answer(next(iter(one.values())), cpu[documents[0][0]])
    # --query-image-id: an indexed image's nearest images, a whole-cache search on the device
    image = cpu[documents[0][0]]["hits"][0]["image_id"]
    by_image = [_json_lines("--index", w, "--query-image-id", image, backend) for backend in (CPU, DEVICE)]
    _same_hits(*(next(iter(b.values()))["hits"] for b in reversed(by_image)))
    # --evaluate test: the same run, and the SR line names what scored
    runs, lines = {}, {}
    for name, backend in (("cpu", CPU), ("device", DEVICE)):
        out = tmp_path / f"{name}.trec"
        proc = run_script("retrieve.py", "--index", w, "--evaluate", "test", "--output", str(out), backend)
        runs[name], lines[name] = _run_file(out), [x for x in proc.stdout.splitlines() if x.startswith("SR:")]
    assert runs["device"].keys() == runs["cpu"].keys() and runs["cpu"]
    for doc_id in runs["cpu"]:
        _same_hits(runs["device"][doc_id], runs["cpu"][doc_id])
    assert lines["cpu"] == ["SR: exact float32 dot product over the whole candidate union (the paper's), on the CPU"]
    assert lines["device"] == ["SR: exact float32 dot product over the whole candidate union on the device (cpu x1, a "
                               "float16 copy of the cache) (the paper's)"]
    # the single-process service, two methods (a list override in one argument), each warmed on the device
    dense = _json_lines("--index", w, "--queries", str(queries / "q.jsonl"), "--method", "dense_summary", CPU)
    _serve_and_compare(w, documents, {"cfir": cpu, "dense_summary": dense})
    # cfir_jax.open(W)
    with cfir_jax.open(workdir, retrieval__sr_backend="device") as on_device, \
            cfir_jax.open(workdir, retrieval__sr_backend="cpu") as on_cpu:
        assert on_device._retriever().sr.backend() == "device" and on_cpu._retriever().sr.backend() == "cpu"
        for doc_id, text in documents:
            got, want = on_device.search(text, id=doc_id), on_cpu.search(text, id=doc_id)
            assert [h.id for h in got.hits] == [h.id for h in want.hits] == \
                [h["image_id"] for h in cpu[doc_id]["hits"]]
            np.testing.assert_allclose([h.score for h in got.hits], [h.score for h in want.hits], rtol=0, atol=1e-5)


def _serve_and_compare(workdir: str, documents, cli: dict) -> None:
    proc = command_server.popen(
        ["retrieve.py", "--index", workdir, "--serve", "--port", "0", DEVICE,
         "--config.serve.methods=cfir,dense_summary"], dict(os.environ), ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    try:
        url = wait_ready(proc, log, 240)
        with httpx.Client(base_url=url, timeout=60) as client:
            for method, answers in cli.items():
                for doc_id, text in documents:
                    answer = client.post("/v1/search", json={"text": text, "id": doc_id, "method": method})
                    assert answer.status_code == 200, answer.text
                    _same_answer(answer.json(), answers[doc_id])
            batch = client.post("/v1/search/batch", json={"documents": [{"id": i, "text": t} for i, t in documents]})
            assert batch.status_code == 200, batch.text
            for result in batch.json()["results"]:
                _same_answer(result, cli["cfir"][result["id"]])
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(log)[-3000:] + err[-3000:]
    assert "Traceback" not in "".join(log) + err
