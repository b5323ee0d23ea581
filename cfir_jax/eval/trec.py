"""TREC qrels and run files, read and written exactly as trec_eval reads them.

Formats (fields separated by any whitespace, one record a line; blank lines and lines starting with `#` skipped):
  qrels: `qid iter docid rel`              iter (usually 0 or Q0) is ignored; rel an integer, > 0 means relevant.
  run:   `qid Q0 docid rank score tag`     trec_eval ignores `rank` and ranks by score descending, ties broken by
                                           docid in descending byte order (strcmp); `write_run` writes ranks in
                                           that same order so the file reads the same to a person and to trec_eval.
AToMiC qrels also ship as parquet (columns text_id, Q0, image_id, rel); `read_qrels` takes those when the path
ends with `.parquet`.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.stores.atomic_write import atomic_file

Qrels = dict[str, dict[str, int]]
Run = dict[str, dict[str, float]]
# A run as the retrieval stage produces it: per topic, (docid, score) pairs or a docid -> score mapping.
RunLike = Mapping[str, Sequence[tuple[str, float]]] | Mapping[str, Mapping[str, float]]

QRELS_COLUMNS = 4
RUN_COLUMNS = 6
PARQUET_QRELS_COLUMNS = ("text_id", "image_id", "rel")
_WHITESPACE = re.compile(r"\s")


def trec_order(hits: Iterable[tuple[str, float]]) -> list[tuple[str, float]]:
    """Sorts (docid, score) pairs the way trec_eval ranks them: score descending, then docid descending.

    trec_eval's comparator (form_res_rels.c) is `sim` descending then `strcmp(p2->docno, p1->docno)`; Python's
    str order is code-point order, which equals the byte order of the UTF-8 encoding strcmp sees.
    """
    return sorted(hits, key=lambda hit: (hit[1], hit[0]), reverse=True)


def _open_text(path: str | os.PathLike, what: str, fix: str):
    """Opens a text file for reading, refusing a missing path or a directory in one line."""
    path = Path(path)
    if not path.exists():
        raise CfirError(f"{path}: {what} file not found; {fix}")
    if path.is_dir():
        raise CfirError(f"{path}: is a directory, expected a {what} file; {fix}")
    return open(path, encoding="utf-8", newline=None)


def _records(path: str | os.PathLike, what: str, columns: int, layout: str) -> Iterator[tuple[int, list[str]]]:
    """Yields (line number, fields) of each record, refusing empty, binary and non-UTF-8 files and wrong columns.

    Blank lines and lines whose first field starts with `#` are skipped, as trec_eval skips them.
    """
    fix = f"expected `{layout}` lines"
    lineno = 0
    seen = False
    with _open_text(path, what, fix) as f:
        try:
            for lineno, line in enumerate(f, 1):
                fields = line.split()
                if len(fields) != columns or "\0" in line:
                    if "\0" in line:
                        raise CfirError(f"{path}:{lineno}: binary data (NUL byte) in a {what} file; {fix}")
                    if not fields or fields[0][0] == "#":
                        continue
                    raise CfirError(f"{path}:{lineno}: {len(fields)} columns, expected {columns} ({layout})")
                if fields[0][0] == "#":
                    continue
                seen = True
                yield lineno, fields
        except UnicodeDecodeError:
            raise CfirError(f"{path}:{lineno + 1}: not UTF-8 text (binary file?); a {what} file must be text") from None
    if not seen:
        raise CfirError(f"{path}: empty {what} file (no records); {fix}")


def read_qrels(path: str | os.PathLike) -> Qrels:
    """Reads TREC qrels (`qid iter docid rel`) or AToMiC parquet qrels into {qid: {docid: rel}}.

    All judgments are kept, rel <= 0 included (trec_eval counts a topic judged only non-relevant as evaluated).
    A docid judged twice for one topic is an error, as in trec_eval.
    """
    if str(path).endswith(".parquet"):
        return _read_parquet_qrels(Path(path))
    qrels: Qrels = {}
    for lineno, (qid, _, docid, rel_text) in _records(path, "qrels", QRELS_COLUMNS, "qid iter docid rel"):
        try:
            rel = int(rel_text)
        except ValueError:
            raise CfirError(f"{path}:{lineno}: relevance {rel_text!r} is not an integer") from None
        judged = qrels.setdefault(qid, {})
        if docid in judged:
            raise CfirError(f"{path}:{lineno}: docid {docid} judged twice for topic {qid}; keep one line")
        judged[docid] = rel
    return qrels


def _read_parquet_qrels(path: Path) -> Qrels:
    """Reads an AToMiC qrels parquet file (text_id, Q0, image_id, rel); Q0 is optional and ignored."""
    # why: pyarrow loads only for AToMiC's parquet qrels
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        raise CfirError(f"{path}: qrels parquet file not found; download the AToMiC qrels or fix the path")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise CfirError(f"{path}: not a readable parquet file ({type(e).__name__}); re-download it") from None
    missing = [c for c in PARQUET_QRELS_COLUMNS if c not in schema.names]
    if missing:
        raise CfirError(f"{path}: parquet qrels lack column(s) {', '.join(missing)}; expected text_id, image_id, rel")
    if not pa.types.is_integer(schema.field("rel").type):
        raise CfirError(f"{path}: column rel has type {schema.field('rel').type}, expected integers")
    table = pq.read_table(path, columns=list(PARQUET_QRELS_COLUMNS))
    if table.num_rows == 0:
        raise CfirError(f"{path}: empty qrels parquet file (no rows)")
    qrels: Qrels = {}
    columns = [table.column(c).to_pylist() for c in PARQUET_QRELS_COLUMNS]
    for row, (qid, docid, rel) in enumerate(zip(*columns)):
        if qid is None or docid is None or rel is None:
            raise CfirError(f"{path}: row {row} has a null text_id, image_id or rel")
        judged = qrels.setdefault(str(qid), {})
        if docid in judged:
            raise CfirError(f"{path}: row {row}: image_id {docid} judged twice for text_id {qid}")
        judged[str(docid)] = int(rel)
    return qrels


def read_run(path: str | os.PathLike) -> Run:
    """Reads a TREC 6-column run into {qid: {docid: score}}; the rank and tag columns are ignored (as trec_eval)."""
    run: Run = {}
    for lineno, (qid, _, docid, _, score_text, _) in _records(path, "run", RUN_COLUMNS, "qid Q0 docid rank score tag"):
        try:
            score = float(score_text)
        except ValueError:
            score = math.nan
        # NaN cannot be ranked; Python's float() reads 1_000 but C's atof (trec_eval) stops at the underscore.
        if score != score or "_" in score_text:
            raise CfirError(f"{path}:{lineno}: score {score_text!r} is not a number")
        hits = run.setdefault(qid, {})
        if docid in hits:
            raise CfirError(f"{path}:{lineno}: docid {docid} appears twice in topic {qid}; trec_eval refuses this")
        hits[docid] = score
    return run


def _check_field(value: str, what: str, where: str) -> str:
    """Returns `value` as a string, refusing an empty one or one with whitespace (it would split a TREC line)."""
    value = str(value)
    if not value or _WHITESPACE.search(value):
        raise CfirError(f"{where}: {what} {value!r} is empty or contains whitespace; TREC files cannot hold it")
    return value


def write_qrels(path: str | os.PathLike, qrels: Mapping[str, Mapping[str, int]]) -> None:
    """Writes qrels as `qid 0 docid rel` lines, topics and docids in the order given, atomically."""
    path = Path(path)
    lines = []
    for qid, judged in qrels.items():
        _check_field(qid, "qid", str(path))
        for docid, rel in judged.items():
            _check_field(docid, "docid", f"{path}: topic {qid}")
            try:
                rel = operator.index(rel)  # ints and numpy integers; a float relevance is refused, not truncated
            except TypeError:
                raise CfirError(f"{path}: topic {qid} docid {docid}: relevance {rel!r} is not an integer") from None
            lines.append(f"{qid} 0 {docid} {rel}\n")
    _write_text_atomic(path, lines)


def write_run(path: str | os.PathLike, run: RunLike, tag: str = "cfir", max_hits: int = 1000) -> None:
    """Writes a TREC 6-column run: per topic the top `max_hits` hits, ranked 1.. as trec_eval ranks them.

    `run` maps qid to (docid, score) pairs or to {docid: score}; the given order does not matter, only scores and
    docids do (trec_eval re-sorts). Scores are written with `repr`, which round-trips a double exactly, so ties and
    order in the file are exactly those of the scores given. Topics without hits write no line (trec_eval cannot
    represent them). Written through a temporary file and a rename.
    """
    path = Path(path)
    tag = _check_field(tag, "tag", str(path))
    if not isinstance(max_hits, int) or max_hits < 1:
        raise CfirError(f"{path}: max_hits={max_hits!r}; use a positive integer (TREC runs usually keep 1000)")
    lines = []
    for qid, hits in run.items():
        qid = _check_field(qid, "qid", str(path))
        pairs = hits.items() if isinstance(hits, Mapping) else hits
        docids, scores = _checked_hits(path, qid, pairs)
        # Tuples compare score first, then docid: reverse order is exactly trec_eval's ranking.
        ranked = sorted(zip(scores, docids), reverse=True)[:max_hits]
        lines += [f"{qid} Q0 {docid} {rank} {score!r} {tag}\n" for rank, (score, docid) in enumerate(ranked, 1)]
    _write_text_atomic(path, lines)


def _checked_hits(path: Path, qid: str, pairs: Iterable) -> tuple[list[str], list[float]]:
    """Splits one topic's (docid, score) pairs into docids and float scores, refusing what a TREC run cannot hold."""
    try:
        pairs = list(pairs)
        docids, raw_scores = zip(*pairs) if pairs else ((), ())
    except (TypeError, ValueError):
        raise CfirError(f"{path}: topic {qid}: hits must be (docid, score) pairs or a docid -> score mapping") from None
    docids = [str(d) for d in docids]
    unique = set(docids)
    # One regex pass over the joined ids finds any id holding whitespace, without a loop in Python.
    if "" in unique or _WHITESPACE.search("".join(docids)):
        bad = next(d for d in docids if not d or _WHITESPACE.search(d))
        raise CfirError(f"{path}: topic {qid}: docid {bad!r} is empty or holds whitespace; TREC files cannot hold it")
    if len(unique) != len(docids):
        seen: set = set()
        dup = next(d for d in docids if d in seen or seen.add(d))
        raise CfirError(f"{path}: docid {dup} appears twice in topic {qid}; deduplicate the hits first")
    try:
        scores = np.asarray(raw_scores, dtype=np.float64)
    except (TypeError, ValueError):
        raise CfirError(f"{path}: topic {qid}: a score is not a number") from None
    if scores.ndim != 1 or np.isnan(scores).any():
        raise CfirError(f"{path}: topic {qid}: a score is NaN or not a scalar; trec_eval cannot rank it")
    return docids, scores.tolist()


def _write_text_atomic(path: Path, lines: list[str]) -> None:
    """Writes `lines` to a temporary file beside `path` and renames it over `path`: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.writelines(lines)
