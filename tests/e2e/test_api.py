"""The library over the session's tiny world: `Index.search` answers what `retrieve.py --format json` prints, the
client's answers equal `Index.search`'s (the real service in a subprocess, one process, over HTTP and through a TLS
proxy; on Ray Serve the same check is tests/e2e/test_serve_cluster.py's, over its cluster), for documents and for an
image by its id, their refusals
are the same lines, a
removed image is never returned again, and every `python` block of docs/python.md runs as written (on the tiny
world: configs/demo.py is its tiny variant, the service's URL the one started here)."""

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT, TINY_CONFIG, run_script
from serving import Service
from tls_proxy import self_signed, tls_proxy

import cfir_jax
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.results import Result


@pytest.fixture(scope="module")
def api_workdir(workdir, tmp_path_factory):
    """A copy of the world the module's service reads (the session's stays untouched)."""
    w = tmp_path_factory.mktemp("api") / "W"
    shutil.copytree(workdir, w)
    return w


@pytest.fixture(scope="module")
def index(api_workdir):
    with cfir_jax.open(api_workdir) as opened:
        yield opened


@pytest.fixture(scope="module")
def service(api_workdir):
    s = Service(api_workdir, "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0")
    yield s
    log = s.stop()
    assert "Traceback" not in log, log[-3000:]


def test_index_search_is_what_retrieve_py_prints(index, api_workdir, documents, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in documents))
    proc = run_script("retrieve.py", "--index", str(api_workdir), "--queries", str(queries), "--format", "json")
    printed = [Result.from_json(json.loads(line)) for line in proc.stdout.splitlines()]
    found = index.search_many([t for _, t in documents], ids=[i for i, _ in documents], top_k=20)
    assert found == printed
    assert [set(r.times_ms) for r in found] == [set(r.times_ms) for r in printed]
    assert found[0].hits and found[0].hits[0].caption and found[-1].note  # captions; the no-entity fallback


def test_the_clients_answers_equal_index_search(service, index, documents):
    client = cfir_jax.Client(service.url)
    assert client.ready()
    for doc_id, text in documents:
        got, expected = client.search(text, id=doc_id, top_k=10), index.search(text, id=doc_id, top_k=10)
        assert got == expected, doc_id
        assert got.version == expected.version == index.version  # the version that answered, on both doors
    ids = [i for i, _ in documents]
    batch = client.search_many([t for _, t in documents], ids=ids, batch=3)
    assert batch == index.search_many([t for _, t in documents], ids=ids)
    assert {r.version for r in batch} == {index.version}
    image = index.search(documents[0][1], top_k=1).ids[0]
    alike = client.search(image_id=image, top_k=5)
    assert alike == index.search(image_id=image, top_k=5) and alike.ids[0] == image


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["tls1.3", "tls1.2"])
def test_the_client_through_a_tls_proxy_answers_as_index_search(service, index, documents, tmp_path, version):
    """The service behind a TLS-terminating proxy with a self-signed certificate (issue 59: over TLS 1.3 the client
    never sent a body)."""
    cert, key = self_signed(tmp_path)
    with tls_proxy(service.url, cert, key, version=version) as url:
        client = cfir_jax.Client(url, ca=cert)
        assert client.ready()
        doc_id, text = documents[0]
        assert client.search(text, id=doc_id, top_k=10) == index.search(text, id=doc_id, top_k=10)
        ids = [i for i, _ in documents[:3]]
        assert client.search_many([t for _, t in documents[:3]], ids=ids) == \
            index.search_many([t for _, t in documents[:3]], ids=ids)
        image = index.search(text, top_k=1).ids[0]
        assert client.search(image_id=image, top_k=5) == index.search(image_id=image, top_k=5)


def test_an_image_the_index_cannot_embed_is_refused_in_the_same_line_by_both(service, index):
    refusals = []
    for door in (cfir_jax.Client(service.url), index):
        with pytest.raises(CfirError) as refused:
            door.search(image=b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1] and "embeddings were imported" in refusals[0] and "\n" not in refusals[0]


@pytest.mark.parametrize("call, refusal", [
    (lambda s: s.search("   "), "text is empty"),
    (lambda s: s.search("A mill.", top_k=0), "top_k=0 out of range: 1 .. {top}"),  # top: retrieval.top_k
])
def test_the_client_and_the_index_refuse_in_the_same_line(service, index, call, refusal):
    for door in (cfir_jax.Client(service.url), index):
        with pytest.raises(CfirError) as refused:
            call(door)
        assert str(refused.value) == refusal.format(top=index.max_top_k), door


ODD_TEXTS = ["  Caf\u00e9 au lait in Paris  ", "Cafe\u0301 in Zu\u0308rich", "tab\tand\fform feed\vand\r\nlines",
             "a\x00b", "bell\x07", "\x7f", "lone \ud800 surrogate", "   \n\t", "", "x" * 70000,
             "\u00e9" * 40000, "emoji \U0001f389 and \u05e2\u05d1\u05e8\u05d9\u05ea", "\u2028line separator\u2029",
             "zero\u200bwidth\ufeff", "\x85next line", 7, None]


def test_the_library_and_the_client_agree_on_odd_texts(service, index):
    """Each text answered by both with the same result, or refused by both in the same line (the one rule: size in
    UTF-8 bytes, Unicode, control characters, NFC, whitespace)."""
    client = cfir_jax.Client(service.url)
    for text in ODD_TEXTS:
        outcomes = []
        for door in (client, index):
            try:
                outcomes.append(door.search(text, top_k=5))
            except CfirError as refused:
                outcomes.append(str(refused))
        assert outcomes[0] == outcomes[1], (repr(text)[:60], outcomes)
        assert not isinstance(outcomes[0], str) or "\n" not in outcomes[0]
    assert isinstance(outcomes[0], str)  # the last (None): refused by both


def test_an_id_over_255_bytes_is_one_line_at_both_doors(service, index):
    """An indexed image's id is never read as a file (a 300-byte name raised a bare OSError); as an image file, such
    a name is one line too."""
    long_id = "img-" + "x" * 300
    refusals = []
    for door in (cfir_jax.Client(service.url), index):
        with pytest.raises(CfirError) as unknown:
            door.search(image_id=long_id, top_k=3)
        refusals.append(str(unknown.value))
        with pytest.raises(CfirError, match=r"cannot read the image \(File name too long\)"):
            door.search(image=long_id, top_k=3)
    assert refusals[0] == refusals[1] and "is not in the index" in refusals[0] and "\n" not in refusals[0]


def test_a_removed_image_is_never_returned_and_the_version_moves(api_workdir, documents, tmp_path):
    w = tmp_path / "W"
    shutil.copytree(api_workdir, w)
    text = documents[0][1]
    with cfir_jax.open(w) as index:
        before = index.version
        first = index.search(text, top_k=1).hits[0].id
        change = index.remove([first])
        assert change["version"] == before + 1 == index.version and change["images_removed"] == 1
        after = index.search(text, top_k=100)
        assert first not in after.ids and after.version == before + 1
        assert index.compact()["version"] == before + 2
        assert first not in index.search(text, top_k=100).ids
        assert index.verify().ok


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)


def test_every_example_of_docs_python_md_runs(api_workdir, service, tmp_path):
    """The page's blocks in order, each in a fresh namespace, in a folder holding demo_work (a copy of the world),
    examples/ and configs/; configs/demo.py reads as its tiny variant, the service's URL as the one started here."""
    blocks = _python_blocks(ROOT / "docs" / "python.md")
    assert len(blocks) >= 6
    shutil.copytree(api_workdir, tmp_path / "demo_work")
    for name in ("examples", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    swaps = {'"configs/demo.py"': repr(TINY_CONFIG), '"http://127.0.0.1:8080"': repr(service.url)}
    code = []
    for block in blocks:
        for old, new in swaps.items():
            block = block.replace(old, new)
        code.append(block)
    runner = "import sys\nfor block in sys.argv[1:]:\n    exec(compile(block, 'docs/python.md', 'exec'), {})\n"
    proc = subprocess.run([sys.executable, "-c", runner, *code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "no_such_work: no index here (missing directory); build it with index.py" in out
    assert "text is empty" in out and "'images_added': 3" in out and "'images_removed': 1" in out
    assert out.count("True") >= 4  # the service ready, an image found first, two versions later, the stores intact


def test_a_query_file_is_searched_as_search_many_with_captions_for_the_shown_hits(index, documents, tmp_path):
    """`retrieve.py --queries` goes through `Index.search_file`: the same answers as `search_many`, the hits past
    `described` (kept for a run file) carry no caption, so a run file reads no captions it does not show."""
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in documents))
    found = index.search_file(queries, jsonl=True, top_k=30, described=3)
    expected = index.search_many([t for _, t in documents], ids=[i for i, _ in documents], top_k=30)
    assert [r.ids for r in found] == [r.ids for r in expected] and found[0].hits
    assert [r.hits[:3] for r in found] == [r.hits[:3] for r in expected]
    assert all(h.caption == h.url == "" for r in found for h in r.hits[3:])


def test_a_bad_query_file_is_refused_before_the_stores_open(api_workdir, tmp_path):
    from cfir_jax.api import operations
    from cfir_jax.api.index import Index

    lazy = Index(operations.config_of(None, api_workdir, {}), api_workdir)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CfirError, match="query file is empty"):
        lazy.search_file(tmp_path / "empty.txt")
    assert not lazy._retrievers  # nothing was opened for a query that could not be read
