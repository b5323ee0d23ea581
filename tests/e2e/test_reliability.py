"""Stores that cannot lie: damage is detected (checksums, --verify, open-time and serving checks), one writer per
workdir, relocatable workdirs, and one line for a full disk, SIGTERM or an unreadable model."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import command_server
import numpy as np
import pytest
from repo import ROOT

from cfir_jax.builders import descriptor
from cfir_jax.core import faults
from cfir_jax.core.cli import load
from cfir_jax.core.errors import CfirError, os_error_line
from cfir_jax.stores import atomic_write, contract, integrity, lock
from cfir_jax.stores.layout import Layout

CONFIG = "configs/demo.py:tiny"


def _built_stores() -> tuple[str, ...]:
    """The stores a demo:tiny build writes, each with its own checksums: from the declarations, every stage of
    index.py that this config wants (`Build.wanted`), in index.py's order."""
    config = load(CONFIG, None)
    stages = descriptor.stages()
    run = descriptor.StageRun(config, Layout.of(ROOT / "no-workdir"), stages, stages)
    return tuple(s.name for s in descriptor.stores()
                 if s.build is not None and (s.build.wanted is None or s.build.wanted(run)))


BUILT = _built_stores()
VERIFIED = len(BUILT)  # what --verify counts
# The stores damaged byte by byte here: all but the images' fields (none in this world; its own tests damage it).
STORE_KINDS = tuple(s for s in BUILT if s != "image_fields")


def _run(*args, check=True, env=None, cwd=ROOT, timeout=900):
    proc = command_server.run(args, cwd=cwd, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _one_line(proc, status, *words):
    assert proc.returncode == status, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One demo:tiny index build (no training: retrieval uses the index encoder), copied by the tests that damage it."""
    w = tmp_path_factory.mktemp("reliability") / "W"
    _run("index.py", "--config", CONFIG, "--workdir", w)
    return w


def _copy(built: Path, to: Path) -> Path:
    shutil.copytree(built, to, symlinks=True)
    return to


def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _retrieve(workdir: Path, n: int = 6):
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.retrieve.pipeline import Retriever

    r = Retriever(workdir_config(workdir), workdir, load_nlp=False)
    docs = r.corpus_documents("test")[:n]
    return [[(h.image_id, round(h.score, 6)) for h in res.hits] for res in r.retrieve_many(docs)]


# ------------------------------------------------------------------------------------------------- atomic writes


def test_atomic_file_leaves_the_old_file_and_no_temporary_on_error(tmp_path):
    path = tmp_path / "x.json"
    atomic_write.write_json_atomic(path, {"a": 1})
    with pytest.raises(RuntimeError), atomic_write.atomic_file(path, "w") as f:
        f.write("half")
        raise RuntimeError("crash mid-write")
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_temp_names_are_unique_and_the_sweep_keeps_live_processes_temporaries(tmp_path):
    final = tmp_path / "store"
    names = {atomic_write.temp_name(final).name for _ in range(100)}
    assert len(names) == 100 and all(str(os.getpid()) in n for n in names)
    live = atomic_write.temp_name(final)
    live.mkdir()
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    dead = tmp_path / live.name.replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    dead.mkdir()
    other_host = tmp_path / f"store.tmp-elsewhere-{dead_pid}-0000"
    other_host.mkdir()
    old_fixed = tmp_path / "store.tmp"  # the fixed name of earlier versions
    old_fixed.mkdir()
    atomic_write.sweep_temps(final)
    assert live.exists() and other_host.exists() and not dead.exists() and not old_fixed.exists()


def test_atomic_dir_failure_leaves_the_old_store_and_no_temporary(tmp_path):
    final = tmp_path / "s"
    with contract.atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(ValueError), contract.atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("new")
        raise ValueError("crash")
    assert (final / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert integrity.verify_store(final) == []


# ----------------------------------------------------------------------------------------------------- checksums


def test_verify_names_the_damaged_block_and_its_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 4096)
    final = tmp_path / "s"
    rows = np.arange(4000 * 8, dtype=np.float32).reshape(4000, 8)  # 32 bytes a row: 128 rows a block
    with contract.atomic_dir(final) as tmp:
        np.save(tmp / "embeddings.npy", rows)
        contract.write_manifest(tmp, "test", 1)
    assert integrity.verify_store(final) == []
    path = final / "embeddings.npy"
    header = np.load(path, mmap_mode="r").offset
    with open(path, "r+b") as f:
        f.seek(header + 1000 * 32 + 4)  # a byte of row 1000: block (header + 32004) // 4096
        f.write(b"\xff")
    block = (header + 1000 * 32 + 4) // 4096
    (problem,) = integrity.verify_store(final)
    assert str(path) in problem and f"block {block} " in problem
    first, last = (block * 4096 - header) // 32, -(-((block + 1) * 4096 - header) // 32) - 1
    assert f"(rows {first:,}-{last:,})" in problem and first <= 1000 <= last
    (final / "extra.bin").write_bytes(b"x")
    (final / "manifest.json").unlink()
    problems = integrity.verify_store(final)
    assert any("manifest.json: missing" in p for p in problems) and any("extra.bin" in p for p in problems)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_a_damaged_byte_in_any_store_is_named_by_verify(built, tmp_path, kind):
    w = _copy(built, tmp_path / "W")
    assert integrity.verify_store(w / kind) == []
    files = [p for p in (w / kind).rglob("*") if p.is_file() and p.name != integrity.CHECKSUMS]
    victim = max(files, key=lambda p: p.stat().st_size)  # the store's bulk: arrays, records, parameters
    _flip_byte(victim)
    proc = _run("index.py", "--verify", "--workdir", w, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(victim) in proc.stderr and "damaged" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # only that file
    assert f"{VERIFIED - 1} store(s) intact" in proc.stdout


def test_verify_of_an_intact_build_passes(built):
    proc = _run("index.py", "--verify", "--workdir", built)
    assert proc.stdout.startswith(f"verify: {VERIFIED} store(s) intact") and not proc.stderr


# ------------------------------------------------------------------------------- what opening and serving refuse


def test_random_bytes_in_the_cache_are_refused_at_query_time_not_ranked_first(built, tmp_path):
    """The fault trial: random bytes in the middle of embeddings.npy made damaged rows rank 1-3 (scores in the
    thousands). Every damaged float16 row scores NaN or far above 1: the query is refused, naming the store."""
    w = _copy(built, tmp_path / "W")
    path = w / "image_cache" / "embeddings.npy"
    emb = np.load(path, mmap_mode="r")
    with open(path, "r+b") as f:
        f.seek(emb.offset + emb.nbytes // 2)
        f.write(np.random.default_rng(0).bytes(min(8192, emb.nbytes // 4)))
    with pytest.raises(integrity.CorruptStore, match=r"image_cache: an impossible score .*index.py --verify"), \
            warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing printed before the refusal: numpy's RuntimeWarning was (issue 51)
        _retrieve(w, n=40)


def test_random_bytes_in_candidate_lists_are_refused_when_opened(built, tmp_path):
    from cfir_jax.stores.entity_index import EntityIndex

    w = _copy(built, tmp_path / "W")
    path = w / "entity_index" / "candidates.npy"
    cand = np.load(path, mmap_mode="r")
    with open(path, "r+b") as f:
        f.seek(cand.offset + cand.nbytes // 2)
        f.write(np.random.default_rng(1).integers(2**20, 2**31 - 1, 64, dtype=np.int32).tobytes())
    with pytest.raises(integrity.CorruptStore, match="entity_index: id .* is outside"):
        EntityIndex.open(w / "entity_index")


def test_out_of_range_candidates_of_a_large_index_are_refused_per_query():
    integrity.check_rows(np.array([0, 5, 9]), 10, "W/entity_index")
    with pytest.raises(integrity.CorruptStore, match="candidate id 10 is outside the 10 cached images"):
        integrity.check_rows(np.array([0, 5, 10]), 10, "W/entity_index")
    with pytest.raises(integrity.CorruptStore, match="candidate id -3"):
        integrity.check_rows(np.array([-3, 5]), 10, "W/entity_index")


def test_impossible_scores_are_refused_and_possible_ones_pass():
    integrity.check_scores(np.array([0.41, -0.2, 1.0004], np.float32), 1.0, "W/image_cache")
    integrity.check_scores(np.zeros(0, np.float32), 1.0, "W/image_cache")
    with pytest.raises(integrity.CorruptStore, match="impossible score NaN"):
        integrity.check_scores(np.array([0.4, np.nan], np.float32), 1.0, "W/image_cache")
    with pytest.raises(integrity.CorruptStore, match="impossible score 6284"):
        integrity.check_scores(np.array([6284.0, 0.4], np.float32), 1.0, "W/image_cache")
    with pytest.raises(integrity.CorruptStore, match="impossible score inf"):
        integrity.check_scores(np.array([np.inf], np.float32), float("inf"), "W/image_cache")


def test_non_monotone_offsets_are_refused():
    integrity.check_csr(np.array([0, 2, 2, 5]), np.arange(5), 5, "W/x")
    with pytest.raises(integrity.CorruptStore, match="not monotone"):
        integrity.check_csr(np.array([0, 3, 2, 5]), np.arange(5), 5, "W/x")


# ------------------------------------------------------------------------------------------- relocatable workdirs


def test_a_moved_workdir_answers_identically_and_records_no_absolute_path(built, tmp_path):
    before = _retrieve(built)
    w = _copy(built, tmp_path / "copy")
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    os.rename(w, moved)
    assert _retrieve(moved) == before
    text = (moved / "index.json").read_text()
    assert str(built) not in text and json.loads(text)["encoder"] == "encoder"
    shutil.rmtree(moved / "encoder")  # the copy's own encoder gone: refused, never the original's loaded
    with pytest.raises(CfirError, match=f"{moved / 'encoder'}"):
        _retrieve(moved)


def test_an_older_index_json_with_absolute_paths_is_read_relative_to_where_the_workdir_is(tmp_path):
    old_root = tmp_path / "old"
    info = {"encoder": str(old_root / "encoder"), "stages": [{"name": "corpus", "path": str(old_root / "corpus")}]}
    assert Layout.of(tmp_path / "new").recorded_path(info, "encoder") == tmp_path / "new" / "encoder"


def test_an_outside_encoder_is_checked_against_its_recorded_fingerprint(tmp_path):
    enc = tmp_path / "models" / "enc"
    enc.mkdir(parents=True)
    (enc / "manifest.json").write_text(json.dumps({"vision_fingerprint": "v1", "text_fingerprint": "t1"}))
    layout = Layout.of(tmp_path / "W")
    info = layout.record_path("encoder", enc)
    assert info == {"encoder": str(enc), "encoder_fingerprint": {"vision_fingerprint": "v1", "text_fingerprint": "t1"}}
    assert layout.recorded_path(info, "encoder") == enc
    (enc / "manifest.json").write_text(json.dumps({"vision_fingerprint": "v2", "text_fingerprint": "t1"}))
    with pytest.raises(CfirError, match=f"expected the encoder at {enc} to have fingerprints .*v1.* but it has .*v2"):
        layout.recorded_path(info, "encoder")
    shutil.rmtree(enc)
    with pytest.raises(CfirError, match=f"the encoder at {enc} \\(fingerprint t1\\) is missing"):
        layout.recorded_path(info, "encoder")


# ------------------------------------------------------------------------------------------------ one writer


# A writer as index.py is one: the lock for its whole run, a store built through atomic_dir. Both processes wait for
# a start file so they try the lock at the same moment; the holder builds only once the other was refused (or after
# 30 s), so the two overlap however loaded the machine is.
WRITER = """
import contextlib, sys, time
from pathlib import Path
import numpy as np
from cfir_jax.stores import contract, lock
from cfir_jax.core.cli import cli_main

@cli_main
def main():
    work, go = Path(sys.argv[1]), Path(sys.argv[2])
    refused = go.with_name(go.name + ".refused")
    while not go.exists():
        time.sleep(0.002)
    held = contextlib.ExitStack()
    try:
        held.enter_context(lock.hold(work, command="writer"))
    except lock.WorkdirBusy:
        refused.touch()
        raise
    with held:
        deadline = time.time() + 30
        while not refused.exists() and time.time() < deadline and sys.argv[3:] != ["alone"]:
            time.sleep(0.01)
        with contract.atomic_dir(work / "stage") as tmp:
            for i in range(4):
                np.save(tmp / f"part{i}.npy", np.arange(1000 * i, dtype=np.int64))
                time.sleep(0.05)
            contract.write_manifest(tmp, "stage", 1, parts=4)
    print("built")

main()
"""


def test_two_writers_started_together_leave_exactly_one_running(tmp_path):
    single = tmp_path / "single"
    go = tmp_path / "go"
    go.touch()
    _run("-c", WRITER, single, go, "alone")
    for attempt in range(20):
        work, go = tmp_path / f"w{attempt}", tmp_path / f"go{attempt}"
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(work), str(go)], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        go.touch()  # both start as soon as they are up: the lock decides, the refused marker ensures overlap
        outs = [(p.wait(60), *p.communicate()) for p in procs]
        codes = sorted(code for code, _, _ in outs)
        assert codes == [0, 2], (attempt, outs)
        loser = next(err for code, _, err in outs if code == 2)
        winner_pid = next(p.pid for p, (code, _, _) in zip(procs, outs) if code == 0)
        assert loser.count("\n") == 1 and f"another writer is running (pid {winner_pid} on host" in loser, loser
        assert sorted(p.name for p in work.iterdir()) == [".writer.lock", "stage"]  # no temporary left behind
        for name in ("part0.npy", "part1.npy", "part2.npy", "part3.npy"):
            assert (work / "stage" / name).read_bytes() == (single / "stage" / name).read_bytes()
        assert integrity.verify_store(work / "stage") == []


def test_index_and_train_refuse_a_workdir_another_writer_holds(tmp_path):
    w = tmp_path / "W"
    with lock.hold(w, command="index.py --workdir W"):
        for command in ("index.py", "train.py"):
            proc = _run(command, "--config", CONFIG, "--workdir", w, check=False, timeout=300)
            _one_line(proc, 2, f"another writer is running (pid {os.getpid()} on host", "index.py --workdir W")
    assert sorted(p.name for p in w.iterdir()) == [".writer.lock"]  # the refused ones wrote nothing


# ---------------------------------------------------------------------------------------------------- faults


def test_an_os_error_without_a_file_name_is_never_none_none():
    assert os_error_line(PermissionError(13, "Permission denied")) == "[Errno 13] Permission denied"
    assert os_error_line(FileNotFoundError(2, "No such file or directory", "/x/params")) == \
        "/x/params: No such file or directory"


def test_an_unreadable_model_is_one_line_naming_the_path_and_the_error_not_hundreds(built, tmp_path):
    """retrieve.py over a workdir whose index encoder lost a parameter file: stderr is one line naming the model and
    what orbax read. orbax's other reads of the failed restore, finalised at exit, used to print ~600 lines of
    tracebacks after it (run as a command: in the test process they would be finalised in some later test)."""
    w = _copy(built, tmp_path / "W")
    params = [p for p in (w / "encoder" / "params").rglob("*") if p.is_file() and p.stat().st_size > 0]
    biggest = max(params, key=lambda p: p.stat().st_size)
    biggest.unlink()
    biggest.mkdir()
    query = tmp_path / "doc.txt"
    query.write_text("A river runs past the old stone bridge of the town.\n")
    for _ in range(2):  # the abandoned reads race the exit: two runs catch a late report more often than one
        line = _one_line(_run("retrieve.py", "--index", w, "--query", query, check=False), 2)
        assert re.fullmatch(f"error: {w / 'encoder'}: cannot read the model's parameters: .*{w / 'encoder' / 'params'}"
                            r".*index\.py --verify.*", line), line
        assert len(line) < 600, line


def test_only_abandoned_orbax_work_is_kept_quiet(monkeypatch):
    """Before any restore failed, only orbax's coroutines, closed-loop callbacks and orbax tasks are dropped; after
    one failed (the process is on its way out with its one line), every report of abandoned async work is."""
    from types import SimpleNamespace

    from cfir_jax.core import errors

    monkeypatch.setattr(errors, "_restore_failed", False)

    async def read():  # a coroutine whose code lives in orbax's package
        pass

    orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py")
    coroutine = read()
    try:
        orbax_coroutine = SimpleNamespace(cr_code=SimpleNamespace(co_filename=orbax_file))
        assert errors._abandoned_async_work(SimpleNamespace(object=orbax_coroutine, exc_value=GeneratorExit()))
        assert errors._abandoned_async_work(SimpleNamespace(object=None,
                                                            exc_value=RuntimeError("Event loop is closed")))
        assert not errors._abandoned_async_work(SimpleNamespace(object=coroutine, exc_value=ValueError("x")))
        assert not errors._abandoned_async_work(SimpleNamespace(object=None, exc_value=RuntimeError("other")))
    finally:
        coroutine.close()
    record = SimpleNamespace(getMessage=lambda: f"Task exception was never retrieved\nfuture: <Task coro=<x() "
                                                f"defined at {orbax_file}:10>>")
    assert errors._abandoned_task_record(record)
    record.getMessage = lambda: "Task exception was never retrieved\nfuture: <Task coro=<mine() at /app/x.py:3>>"
    assert not errors._abandoned_task_record(record)
    monkeypatch.setattr(errors, "_restore_failed", True)
    assert errors._abandoned_task_record(record)
    assert errors._abandoned_async_work(SimpleNamespace(object=None, exc_value=ValueError("x")))


def test_disk_full_inside_a_store_write_is_one_line_and_leaves_nothing_that_passes_as_complete(tmp_path):
    final = tmp_path / "image_cache"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(final / "embeddings.npy"))

    with pytest.raises(faults.DiskFull) as info, faults.stage("image_cache"), contract.atomic_dir(final) as tmp:
        (tmp / "ids.txt").write_bytes(b"x" * (3 << 20))
        full()
    message = str(info.value)
    assert message.startswith(f"no space left on {faults.mount_of(tmp_path)} while writing {final} (stage "
                              "image_cache); free more than 3.0 MB (what it had written"), message
    assert message.endswith("and rerun: finished stages are kept") and "\n" not in message
    assert not final.exists() and list(tmp_path.iterdir()) == []


# Runs index.py with the store floor's checksum step (run inside every store's commit) failing with ENOSPC once
# the stage named by $FULL_AT commits: the injected equivalent of the disk filling while writing that store.
DISK_FILLER = """
import errno, os, runpy, sys
from cfir_jax.stores import integrity

target = os.environ["FULL_AT"]
write = integrity.write_checksums


def full(directory, *args):
    if os.path.basename(str(directory)).startswith(target + ".tmp"):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return write(directory, *args)


integrity.write_checksums = full
sys.argv = ["index.py", *sys.argv[1:]]
runpy.run_path("index.py", run_name="__main__")
"""


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow  # a failed build and a resumed one: 40-60 s on 2 cores
@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_a_full_disk_during_index_is_one_line_exit_2_and_the_rerun_completes(built, tmp_path, how):
    """ENOSPC while building: one line naming the device and the store, exit 2, every store present is complete
    (verify passes on it), and a rerun with space resumes to the stores of an uninterrupted build. On a machine
    where a small tmpfs cannot be mounted (not root), the ENOSPC is injected at the same point instead."""
    mount = tmp_path / "disk"
    mounted = how == "tmpfs" and _tmpfs(mount, "2m")
    try:
        if mounted:
            w = mount / "W"
            proc = _run("index.py", "--config", CONFIG, "--workdir", w, check=False)
            stage = "corpus" if not (w / "corpus").exists() else None
        else:
            w = tmp_path / "W"
            proc = _run("-c", DISK_FILLER, "--config", CONFIG, "--workdir", w, check=False,
                        env={"FULL_AT": "entities"})
            stage = "entities"
        line = _one_line(proc, 2, "error: no space left on ", "while writing ", "and rerun: finished stages are kept")
        if stage:
            assert f"(stage {stage})" in line, line
        if mounted:
            assert "(tmpfs)" in line, line
        for name in STORE_KINDS:  # a store is there complete (it verifies) or not at all; run dirs resume
            if (w / name).exists():
                assert integrity.verify_store(w / name) == [], name
        assert not [p for p in w.rglob("*.tmp-*")] if w.exists() else True
        rerun_at = tmp_path / "roomy"
        if w.exists():
            shutil.copytree(w, rerun_at)
        _run("index.py", "--config", CONFIG, "--workdir", rerun_at)
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=True)
    for rel in ("image_cache/embeddings.npy", "entity_index/candidates.npy", "entities/entity_ids.npy"):
        np.testing.assert_array_equal(np.load(rerun_at / rel), np.load(built / rel), err_msg=rel)


@pytest.mark.slow  # an interrupted build and a resumed one: ~50 s on 2 cores
def test_sigterm_to_index_says_where_exits_143_and_the_rerun_resumes_to_identical_stores(built, tmp_path):
    w = tmp_path / "W"
    proc = command_server.popen(["index.py", "--config", CONFIG, "--workdir", w],
                                {**os.environ, "PYTHONUNBUFFERED": "1"}, ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("[entities] ..."):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] in ("interrupted during entities; rerun to resume",
                         "interrupted during summaries; rerun to resume"), err[-3000:]
    assert not (w / ".writer.lock").read_text()  # released: the rerun may start
    _run("index.py", "--config", CONFIG, "--workdir", w)
    for rel in ("image_cache/embeddings.npy", "entity_index/candidates.npy", "entities/entity_ids.npy",
                "image_text/embeddings.npy"):
        np.testing.assert_array_equal(np.load(w / rel), np.load(built / rel), err_msg=rel)
    for rel in ("entities/vocab.txt", "summaries/summaries.jsonl", "entity_index/vocab.json"):
        assert (w / rel).read_text() == (built / rel).read_text(), rel


def test_a_rebuilt_stage_marks_the_stages_derived_from_it_stale(built, tmp_path):
    w = _copy(built, tmp_path / "W")
    proc = _run("index.py", "--config", CONFIG, "--workdir", w, "--stages", "entity_index",
                "--config.index.entity_index.k=7")
    table = proc.stdout
    assert "entity_text_match" in table and "STALE" in table, table
    assert (f"stale: entity_text_match (entity_index rebuilt); refresh with: python index.py --config CONFIG "
            f"--workdir {w} --stages entity_text_match") in table, table
    assert "nothing to do" not in table


# ------------------------------------------------------------------------------ issue 26: damage named where it is
def test_impossible_embeddings_name_the_model_not_a_store():
    good = np.eye(3, 8, dtype=np.float32)
    integrity.check_embeddings(good, "W/model")
    integrity.check_embeddings(np.zeros((0, 8), np.float32), "W/model")
    with pytest.raises(integrity.CorruptStore, match=r"^W/model: a query embedding is not finite: the model's "
                                                     r"parameters are damaged; run index.py --verify"):
        integrity.check_embeddings(np.where(good > 0, np.nan, good), "W/model")
    with pytest.raises(integrity.CorruptStore, match="W/encoder: an entity embedding is of norm 3, not 1"):
        integrity.check_embeddings(3 * good, "W/encoder", "entity")


def test_a_model_giving_nan_is_named_and_the_cache_is_not_blamed(built, tmp_path):
    """The fault trial: 8 bytes overwritten in an orbax file of the model gave NaN query embeddings, refused as
    "W/image_cache: an impossible score NaN" although the cache was intact."""
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.retrieve.pipeline import Retriever

    config = workdir_config(built)
    with config.unlocked():
        config.retrieval.caption_cache = 3
    r = Retriever(config, built, load_nlp=False)
    docs = r.corpus_documents("test")[:2]
    ids = [h.image_id for h in r.retrieve_many(docs)[0].hits]
    for image_id in ids[:6]:  # the caption cache keeps the last 3 images shown, and answers as the corpus does
        assert r.describe_image(image_id) == (r.corpus.image(r.corpus.image_ids.index(image_id)).caption,
                                              r.corpus.image(r.corpus.image_ids.index(image_id)).url)
    assert r._caption.cache_info().currsize == 3
    encode = r.stores.query_encoder.encode
    r.stores.query_encoder.encode = lambda texts: encode(texts) * np.nan
    with pytest.raises(integrity.CorruptStore) as caught:
        r.retrieve_many(docs)
    message = str(caught.value)
    assert message.startswith(str(r.stores.model_dir)) and "query embedding is not finite" in message
    assert "image_cache" not in message


def test_a_paced_verification_keeps_its_rate_and_names_the_same_damage(tmp_path):
    directory = tmp_path / "store"
    directory.mkdir()
    np.save(directory / "rows.npy", np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32))
    (directory / "manifest.json").write_text("{}")
    integrity.write_checksums(directory)
    _flip_byte(directory / "rows.npy")
    fast = integrity.verify_store(directory)
    t0 = __import__("time").monotonic()
    paced = integrity.verify_store(directory, integrity.Throttle(4e6))  # 2.1 MB at 4 MB/s: about half a second
    assert __import__("time").monotonic() - t0 >= 0.4
    assert paced == fast and len(fast) == 1 and "rows.npy: damaged (checksum differs in block 0" in fast[0]
