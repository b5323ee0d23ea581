"""index.py over the processes of a jax.distributed run: 2 processes x 4 CPU devices build the very stores one
process builds, and a SIGKILLed 2-process build resumes, reusing its finished chunks, to the same stores."""

import os
import socket
import subprocess
from pathlib import Path

import command_server
import pytest
from repo import ROOT
from test_index import write_inputs

WORKER = str(ROOT / "tests" / "helpers" / "index_worker.py")
STORES = ("image_cache", "entities", "summaries", "entity_index", "image_text", "entity_text_match")
# Manifest fields that say when or by how many processes a store was built, not what it holds; cache_fingerprint
# names the image cache's build (its build time included) and is checked against each workdir's own cache instead;
# entity_index (of entity_text_match) likewise names the entity index's build.
BUILD_FIELDS = {"created", "build_seconds", "processes", "cache_fingerprint", "entity_index"}
# One chunk per document, entity and two images: every chunked stage has several chunks for each process.
OVERRIDES = ("--config.index.entities.chunk_size=1", "--config.index.summaries.chunk_size=1",
             "--config.index.entity_index.chunk_size=1", "--config.index.entity_index.documents=all",
             "--config.index.image_text.enabled=True", "--config.index.image_text.chunk_rows=2",
             "--config.index.entity_text_match.enabled=True", "--config.index.entity_text_match.chunk_rows=2")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _start(nproc: int, config: Path, work: Path, logs: Path, kill_after: int = -1) -> list[subprocess.Popen]:
    """index.py as the nproc processes of one job, each with 4 CPU devices; process p logs its chunks to logs/p."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               CFIR_PROGRESS="0")
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    return [command_server.popen([WORKER, p, nproc, port, logs / str(p), kill_after if p == 1 else -1, "--config",
                                  config, "--workdir", work, *OVERRIDES],
                                 env, ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p in range(nproc)]


def _finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Every process's stdout once all exited 0; a hung job (a process waiting for a dead one) is killed and fails."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the job hung for {timeout} s: " + " | ".join(p.communicate()[1][-1500:] for p in procs))
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return [out for out, _ in outs]


def _calls(logs: Path) -> list[str]:
    return [line for f in sorted(logs.glob("*")) for line in f.read_text().splitlines()]


@pytest.fixture(scope="module")
def builds(tmp_path_factory, synthetic_spm):
    """The AToMiC fixture and its tiny encoder, built by 1 process and by 2 processes (4 CPU devices each)."""
    root = tmp_path_factory.mktemp("multihost")
    _, config = write_inputs(root, synthetic_spm)
    one, two = _start(1, config, root / "W1", root / "logs1"), _start(2, config, root / "W2", root / "logs2")
    outs = _finish(one) + _finish(two)
    return dict(root=root, config=config, one=root / "W1", two=root / "W2", outs=outs, calls2=_calls(root / "logs2"))


def _assert_same_stores(a: Path, b: Path) -> None:
    """Every store of workdir `a` equals `b`'s: arrays and text files byte for byte, manifests but for BUILD_FIELDS."""
    import json

    from cfir_jax.stores.contract import manifest_digest
    from cfir_jax.stores.image_cache import ImageCache
    from cfir_jax.stores.integrity import CHECKSUMS, verify_store

    for store in STORES:
        files = sorted(p.relative_to(a / store) for p in (a / store).rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b / store) for p in (b / store).rglob("*") if p.is_file()), store
        assert len(files) > 1, store  # data beside the manifest
        for f in files:
            if f.name == "manifest.json":
                ma, mb = json.loads((a / store / f).read_text()), json.loads((b / store / f).read_text())
                assert {k: v for k, v in ma.items() if k not in BUILD_FIELDS} == \
                    {k: v for k, v in mb.items() if k not in BUILD_FIELDS}, store
                for work, m in ((a, ma), (b, mb)):
                    if "cache_fingerprint" in m:  # derived from this workdir's own cache build
                        assert m["cache_fingerprint"] == ImageCache.open(work / "image_cache").content_fingerprint
                    if store == "entity_text_match":
                        assert m["entity_index"] == manifest_digest(json.loads(
                            (work / "entity_index" / "manifest.json").read_text()))
            elif f.name == CHECKSUMS:  # equal but for the manifests' own sums (their build fields differ)
                ca, cb = (json.loads((w / store / f).read_text()) for w in (a, b))
                for c in (ca, cb):
                    c["files"] = {k: v for k, v in c["files"].items() if Path(k).name != "manifest.json"}
                assert ca == cb, f"{store}/{f}"
            else:
                assert (a / store / f).read_bytes() == (b / store / f).read_bytes(), f"{store}/{f}"
        for work in (a, b):  # each workdir's own sums hold for its files, its manifests included
            assert verify_store(work / store) == [], store
    for store in STORES:  # no work directory left behind
        assert not list(b.glob(f"*{store}.partial")) and not list(b.glob(f".{store}.building"))


def test_two_processes_build_the_stores_one_process_builds(builds):
    _assert_same_stores(builds["one"], builds["two"])
    for store in ("entities", "summaries"):  # both processes computed chunks, none twice
        chunks = [c for c in builds["calls2"] if c.startswith(f"{store}.")]
        assert len(chunks) == len(set(chunks)) >= 4
    assert all((builds["root"] / "logs2" / p).read_text() for p in ("0", "1"))
    one, two = (json_manifest(builds[w] / "image_cache") for w in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)
    one_out, two_out0, two_out1 = builds["outs"]  # the closing table (and the stage log) on process 0 only
    assert "entity_index" in one_out and "entity_index" in two_out0 and "entity_index" not in two_out1


def json_manifest(store: Path) -> dict:
    import json

    return json.loads((store / "manifest.json").read_text())


def test_killed_process_resumes_to_the_same_stores_reusing_finished_chunks(builds, tmp_path):
    work, logs = tmp_path / "W", tmp_path / "logs"
    procs = _start(2, builds["config"], work, logs / "killed", kill_after=0)
    procs[1].wait(timeout=600)
    assert procs[1].returncode == -9, procs[1].stderr.read()[-3000:]
    procs[0].kill()  # a cluster restarts the whole job when a host dies
    procs[0].communicate(timeout=60)
    partial = work / "summaries.partial"
    finished = {f"summaries.partial/{p.name}" for p in partial.glob("chunk-*.json")}
    written = {c for c in _calls(logs / "killed") if c.startswith("summaries.")}
    assert finished == written and not (work / "summaries").exists()
    total = len([c for c in builds["calls2"] if c.startswith("summaries.")])
    assert 0 < len(finished) < total

    _finish(_start(2, builds["config"], work, logs / "resumed"))
    redone = [c for c in _calls(logs / "resumed") if c.startswith("summaries.")]
    assert not finished & set(redone) and len(finished) + len(redone) == total  # each chunk computed once
    assert not [c for c in _calls(logs / "resumed") if c.startswith("entities.")]  # committed before the kill
    _assert_same_stores(builds["one"], work)


def test_model_directory_written_by_process_0_is_loaded_by_both(tmp_path):
    """Orbax must neither wait for process 1 while process 0 exports, nor restore onto process 0's devices."""
    from cfir_jax.core.config import model_config
    from cfir_jax.model import checkpoint
    from cfir_jax.model.beit3 import create_model

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    port = _free_port()
    procs = [command_server.popen([WORKER, "model", p, port, tmp_path / "model"], env, ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for p in (0, 1)]
    outs = _finish(procs, timeout=120)
    cfg = model_config("tiny", embed_dim=32, num_layers=1, num_heads=2, ffn_dim=64, image_size=32, vocab_size=100)
    model = create_model(cfg, seed=3)
    want = f"{checkpoint.fingerprint(model, 'vision')} {checkpoint.fingerprint(model, 'text')}"
    assert all(want in out.splitlines() for out in outs), outs
