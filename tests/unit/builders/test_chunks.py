"""The chunked multi-host builds (cfir_jax/builders/chunks.py): chunks owned round-robin, reused by a rerun with another
process count."""

from cfir_jax.builders import chunks
from cfir_jax.core import hosts


def test_chunks_of_a_two_process_run_are_reused_by_a_one_process_rerun(tmp_path, monkeypatch):
    """Process 1 of 2 computes chunks 1 and 3 only and yields nothing (process 0 assembles); a rerun with one
    process computes the rest, reuses those two whoever wrote them, and yields every chunk in order."""
    docs = [(f"d{i}", f"text {i}") for i in range(9)]
    computed: list[list[str]] = []

    def process(texts):
        computed.append(list(texts))
        return [t.upper() for t in texts]

    with monkeypatch.context() as m:  # a 2-process job whose barriers are no-ops
        m.setattr(hosts, "process_count", lambda: 2)
        m.setattr(hosts, "barrier", lambda name: None)
        m.setattr(hosts, "process_index", lambda: 0)  # process 0 prepares the partial directory (no documents yet)
        assert list(chunks.iter_chunks(tmp_path / "s", [], process, {"v": 1}, chunk_size=2)) == []
        m.setattr(hosts, "process_index", lambda: 1)
        assert list(chunks.iter_chunks(tmp_path / "s", docs, process, {"v": 1}, chunk_size=2)) == []
    assert computed == [["text 2", "text 3"], ["text 6", "text 7"]]

    computed.clear()
    owned = list(chunks.iter_chunks(tmp_path / "s", docs, process, {"v": 1}, chunk_size=2))
    assert computed == [["text 0", "text 1"], ["text 4", "text 5"], ["text 8"]]
    assert [i for ids, _ in owned for i in ids] == [d for d, _ in docs]
    assert [r for _, results in owned for r in results] == [t.upper() for _, t in docs]
