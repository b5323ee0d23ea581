"""The public records of a search: `Result` and its `Hit`s, what `cfir_jax.open(W).search(...)` and
`cfir_jax.Client(url).search(...)` return alike.

A `Result` is the JSON of `retrieve.py --format json` and of the service's `POST /v1/search` made typed: `to_json`
writes that JSON (`cfir_jax.retrieve.report.as_json` is `to_json` of the record, so the command, the service and the
library answer from one shape) and `from_json` reads it back (the client). Two results are equal when their answers
are: `times_ms`, measured per run, and `version`, the index version that answered (the service sends it in the
`X-Index-Version` header, not in the JSON), are left out of the comparison: one answer is the same whichever
version gave it, and a result read back from its JSON equals the result written. This module imports nothing heavy,
so the client stays free of JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the annotation of `Result.of` only: the client imports this module without the pipeline's JAX
    from cfir_jax.retrieve.pipeline import Retrieval

__all__ = ["Hit", "Result"]


@dataclasses.dataclass(frozen=True)
class Hit:
    """One image of the answer, best first."""

    rank: int  # 1-based
    id: str  # the image's id in the corpus
    score: float  # SR's score (or the method's), higher is better
    caption: str  # the image's caption in the corpus ('' when it has none)
    url: str  # where the image comes from ('' when unknown)
    entities: tuple[str, ...] = ()  # the document's entities whose candidate lists brought this image in
    duplicates: tuple[str, ...] = ()  # the ids of its near-duplicates folded under it, best first (docs/duplicates.md)
    # the image's own fields as its images row gave them (date, source, license, tags, ...: docs/filters.md), its
    # nulls left out; empty for a collection without fields (the JSON then has no "fields", as before)
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class Result:
    """The answer for one document (or image): its hits and how they were found."""

    id: str  # the query's id (a document's, or "query")
    hits: tuple[Hit, ...]
    entities: tuple[str, ...] = ()  # entities found in the document (normalised)
    unknown_entities: tuple[str, ...] = ()  # of those, the ones the index had not seen
    summary: str = ""  # the document's summary that SR embedded ('' for methods that read none)
    note: str = ""  # what the retriever decided that the reader should know (e.g. the no-entity fallback)
    num_candidates: int = 0  # size of the candidate union SR scored
    times_ms: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)  # per stage, this run
    version: int | None = dataclasses.field(default=None, compare=False)  # the index version that answered
    # fast SR's top-k overlap with exact scoring, when measured (`retrieve.py --qrels`); not in the JSON
    sr_agreement: float | None = dataclasses.field(default=None, compare=False)
    lang: str = "en"  # the document's language, stated or found (docs/languages.md)
    # a filter's count: the images that pass the query's filters, of the live images (None: no filter); the note
    # says it in words, the JSON carries the note only
    passed: int | None = dataclasses.field(default=None, compare=False)
    live: int | None = dataclasses.field(default=None, compare=False)
    # the facets asked (docs/filters.md): {field: {value: images}}, the 20 largest values of each, over the `ranked`
    # images the query ranked (near-duplicates folded count once); None: none asked (the JSON then has neither)
    facets: Mapping[str, Mapping[str, int]] | None = None
    ranked: int | None = None
    # What evaluation and the fits read beyond the JSON (never sent, not compared): the hits' cache rows (a fit
    # re-fuses its lists by row), the re-ranker's features of SR's top-N ([n, F], when the index collects them),
    # and the candidates BM25 added beyond ER's union.
    rows: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    rerank_features: Any = dataclasses.field(default=None, compare=False)
    lexical_added: int = dataclasses.field(default=0, compare=False)

    @classmethod
    def of(cls, doc_id: str, result: Retrieval, describe: Callable[[str], tuple[str, str]], top: int,
           version: int | None = None, described: int | None = None,
           fields: Callable[[str], Mapping[str, Any]] | None = None) -> Result:
        """The record of the pipeline's answer (`cfir_jax.retrieve.pipeline.Retrieval`), its first `top` hits,
        with each hit's (caption, url) from `describe(image_id)` and its own fields from `fields(image_id)` (none
        when None) for the first `described` hits (all when None; the rest, kept for a run file or a measure, have
        none); version: the index version that answered. Only the library's `Index` calls this: it is the one
        conversion of a result."""
        described = top if described is None else described
        passed, counted = result.passed, result.facets  # (pass, of the live) of a filter; (facets, ranked) asked
        hits = []
        for n, h in enumerate(result.hits[:top]):
            caption, url = describe(h.image_id) if n < described else ("", "")
            own = dict(fields(h.image_id)) if fields is not None and n < described else {}
            hits.append(Hit(h.rank, h.image_id, h.score, caption, url, tuple(h.entities), tuple(h.duplicates), own))
        return cls(doc_id, tuple(hits), tuple(result.entities), tuple(result.unknown_entities), result.summary,
                   result.note, result.num_candidates, dict(result.times_ms), version,
                   sr_agreement=result.sr_agreement, lang=result.lang,
                   passed=passed[0] if passed else None, live=passed[1] if passed else None,
                   facets=counted[0] if counted else None, ranked=counted[1] if counted else None,
                   rows=tuple(h.row for h in result.hits[:top]), rerank_features=result.rerank_features,
                   lexical_added=result.lexical_added)

    def to_json(self) -> dict:
        """The JSON object of `retrieve.py --format json` and of `POST /v1/search` (keys in that order; "facets"
        and "ranked" last, only where facets were asked; a hit's "fields" last, only where its image has any)."""
        counted = {} if self.facets is None else {
            "facets": {f: dict(c) for f, c in self.facets.items()}, "ranked": self.ranked}
        return {
            "id": self.id, "lang": self.lang, "entities": list(self.entities),
            "unknown_entities": list(self.unknown_entities),
            "num_unknown_entities": len(self.unknown_entities),
            "summary": self.summary, "note": self.note, "num_candidates": self.num_candidates,
            "times_ms": dict(self.times_ms),
            "hits": [{"rank": h.rank, "image_id": h.id, "score": h.score, "entities": list(h.entities),
                      "caption": h.caption, "url": h.url, "duplicates": list(h.duplicates),
                      **({"fields": dict(h.fields)} if h.fields else {})} for h in self.hits],
            **counted,
        }

    @classmethod
    def from_json(cls, answer: Mapping[str, Any], version: int | None = None) -> Result:
        """The record of one answer of the service (`to_json`'s shape); version: its X-Index-Version header."""
        hits = tuple(Hit(int(h["rank"]), str(h["image_id"]), float(h["score"]), str(h.get("caption", "")),
                         str(h.get("url", "")), tuple(h.get("entities", ())), tuple(h.get("duplicates", ())),
                         dict(h.get("fields") or {}))
                     for h in answer["hits"])
        facets = answer.get("facets")
        return cls(str(answer["id"]), hits, tuple(answer.get("entities", ())),
                   tuple(answer.get("unknown_entities", ())), str(answer.get("summary", "")),
                   str(answer.get("note", "")), int(answer.get("num_candidates", 0)),
                   {str(k): float(v) for k, v in answer.get("times_ms", {}).items()}, version,
                   lang=str(answer.get("lang", "en")),
                   facets=None if facets is None else {str(f): {str(v): int(n) for v, n in c.items()}
                                                       for f, c in facets.items()},
                   ranked=None if facets is None else int(answer.get("ranked", 0)))

    @property
    def ids(self) -> list[str]:
        """The hits' image ids, best first."""
        return [h.id for h in self.hits]
