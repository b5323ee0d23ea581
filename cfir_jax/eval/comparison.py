"""The comparison rows of `retrieve.py --evaluate SPLIT --compare`, as data: the paper's Table 3 and the rows beyond.

A row is a name, a method, config overrides (dotted keys, e.g. "retrieval.text" or "retrieval.fusion.w_txt") and the
label the table prints. Table 3 of the CFIR paper (ablation, AToMiC base) comes first; "entities + document" scores the
entity candidate union with the document's embedding instead of the summary's. The paper's rows stay the paper's
whatever retrieval.fusion, entity_text_match and rerank say (`PAPER_SETTINGS`); the rows beyond the paper follow, each
when its store exists: CFIR fused with the image text (W/image_text), with the entity text matches
(W/entity_text_match), BM25 over the image text and CFIR with it (W/lexical), and re-ranked by the third stage
(W/reranker). Last, D-BEiT-3 Full (the paper's whole-model fine-tuning, Tables 1-2): dense document search with
W/model_full over the image cache its own vision tower encoded (W/image_cache_full); when either is missing,
`full_row_note` says which command makes it. A row that varies one more setting (say Table 4's K, `retrieval.k`)
is one more line here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from cfir_jax.core.errors import CfirError
from cfir_jax.stores.convex_fusion import FusionWeight
from cfir_jax.stores.layout import Layout


@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # an identifier (stable across label wording)
    method: str  # cfir | dense_document | dense_summary | entity_only
    overrides: dict[str, Any]  # dotted config key -> value, applied over the evaluated config
    label: str  # what the table prints

    def config(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of config with this row's overrides."""
        out = config.copy_and_resolve_references()
        for key, value in self.overrides.items():
            *path, leaf = key.split(".")
            node = out
            for part in path:
                node = node[part]
            node[leaf] = value
        return out

    def with_overrides(self, **overrides: Any) -> Row:
        """The row with more overrides (keys with dots given as '__': retrieval__text)."""
        more = {k.replace("__", "."): v for k, v in overrides.items()}
        return dataclasses.replace(self, overrides={**self.overrides, **more})


NO_FUSION = {"retrieval.fusion.w_img": 1.0, "retrieval.fusion.w_txt": 0.0}
NO_RERANK = {"retrieval.rerank.enabled": False}
NO_TEXT_MATCH = {"retrieval.entity_text_match": False}
# The paper drops the query entities its index never saw; retrieval.unknown_entities="search" (the default for a
# user's own queries) is the authors' code's rule plus this project's query-time search, so the paper's rows reset it.
PAPER_RULES = {"retrieval.unknown_entities": "ignore"}
PAPER_SETTINGS = {**NO_FUSION, **NO_RERANK, **NO_TEXT_MATCH, **PAPER_RULES}

TABLE3 = (
    Row("document_only", "dense_document", PAPER_SETTINGS, "document only"),
    Row("entities_only", "entity_only", PAPER_SETTINGS, "entities only"),
    Row("summary_only", "dense_summary", PAPER_SETTINGS, "summary only"),
    Row("entities_document", "cfir", {**PAPER_SETTINGS, "retrieval.text": "document"}, "entities + document"),
    Row("full_cfir", "cfir", PAPER_SETTINGS, "full CFIR"),
)
# Beyond the paper. The fused row's text weight is the configured one, or retrieval.fusion.compare_w_txt when fusion
# is off (`comparison_rows` fills it in).
FUSED = Row("image_text", "cfir", {**NO_RERANK, **NO_TEXT_MATCH}, "CFIR + image text")
TEXT_MATCH = Row("entity_text_match", "cfir", {**NO_FUSION, **NO_RERANK, "retrieval.entity_text_match": True},
                 "CFIR + entity text match")
RERANK = Row("rerank", "cfir", {**NO_FUSION, **NO_TEXT_MATCH, "retrieval.rerank.enabled": True}, "CFIR + re-rank")
FUSED_RERANK = Row("image_text_rerank", "cfir", {**NO_TEXT_MATCH, "retrieval.rerank.enabled": True},
                   "CFIR + image text + re-rank")

# Beyond the paper, over the images' own text (W/lexical): BM25 alone, BM25's top M in CFIR's union, and CFIR's
# ranking fused with BM25's. Each changes one thing from "full CFIR" (the paper's settings otherwise).
LEXICAL = (Row("bm25", "bm25", PAPER_SETTINGS, "BM25 (image text)"),
           Row("bm25_candidates", "cfir_bm25", PAPER_SETTINGS, "CFIR + BM25 candidates"),
           Row("bm25_fused", "cfir_bm25_fused", PAPER_SETTINGS, "CFIR + BM25 fused"))
# Beyond the paper, when retrieve.py --fit-fusion fitted its weight (W/convex_fusion): the convex fusion of SR and BM25.
CONVEX = Row("bm25_convex", "cfir_bm25_convex", {**PAPER_SETTINGS, "retrieval.lexical.alpha": -1.0},
             "CFIR + BM25 convex")

# Beyond the paper, when retrieve.py --fit-fusion fitted its weight (W/convex_fusion, pair image_text): ER's union
# ranked by the convex fusion of the image's and its own text's scores; the settings of the linear fused row
# beside it, which stays.
TEXT_CONVEX = Row("image_text_convex", "cfir_text_convex",
                  {**NO_FUSION, **NO_RERANK, **NO_TEXT_MATCH, "retrieval.fusion.alpha": -1.0},
                  "CFIR + image text convex")

# Beside document only (the frozen vision tower) and CFIR: both towers trained, the document at its training length.
FULL = Row("full", "dense_document", {**PAPER_SETTINGS, "retrieval.model": "full", "retrieval.image_cache": ""},
           "D-BEiT-3 Full")


def k_rows(ks, method: str = "cfir") -> tuple[Row, ...]:
    """Table 4 of the paper (full CFIR at each K of `ks`, ascending) from one index: each row reads the entity index
    cut at its K (`retrieval.k`; lists are stored best first, so the index built at the largest K holds the others).
    With method cfir_bm25 the same sweep is over M, the BM25 candidates each document adds to the union
    (`retrieval.lexical.candidates`; M = 0 is full CFIR), and with cfir_bm25_fused over BM25's weight in the fusion
    (`retrieval.lexical.fuse_weight`)."""
    if method == "cfir_bm25":
        return tuple(Row(f"m_{m}", method, {**PAPER_SETTINGS, "retrieval.lexical.candidates": m},
                         f"CFIR + BM25 candidates, M = {m:,}") for m in sorted(set(ks)))
    if method == "cfir_bm25_fused":  # the fusion weight, chosen on the validation split
        return tuple(Row(f"w_{w:g}", method, {**PAPER_SETTINGS, "retrieval.lexical.fuse_weight": float(w)},
                         f"CFIR + BM25 fused, weight {w:g}") for w in sorted(set(ks)))
    return tuple(Row(f"k_{k}", "cfir", {**PAPER_SETTINGS, "retrieval.k": k}, f"full CFIR, K = {k:,}")
                 for k in sorted(set(ks)))


def parse_ks(text: str, minimum: int = 1) -> tuple[int, ...]:
    """'1000,5000,10000,15000' -> (1000, 5000, 10000, 15000); anything else is one ValueError line (minimum: the
    least value allowed, 0 for BM25's M)."""
    what = "positive integers" if minimum else "integers >= 0"
    try:
        ks = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--compare-k {text!r}: expected {what} separated by commas") from None
    if not ks or min(ks) < minimum:
        raise ValueError(f"--compare-k {text!r}: expected {what} separated by commas")
    return ks


def parse_weights(text: str) -> tuple[float, ...]:
    """'0.25,0.5,1,2' -> (0.25, 0.5, 1.0, 2.0): the fusion weights --compare-k sweeps with cfir_bm25_fused."""
    try:
        ws = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--compare-k {text!r}: expected weights >= 0 separated by commas") from None
    if not ws or min(ws) < 0:
        raise ValueError(f"--compare-k {text!r}: expected weights >= 0 separated by commas")
    return ws


def single_row(method: str) -> Row:
    """The row of `--evaluate SPLIT --method M` without --compare: the configuration as given."""
    return Row(method, method, {}, method)


def comparison_rows(config: ml_collections.ConfigDict, workdir) -> tuple[Row, ...]:
    """Table 3's rows, then each row beyond the paper whose store the workdir holds (the re-ranked rows also when
    retrieval.rerank.enabled asks for them: a missing W/reranker is then refused in one line)."""
    rcfg, layout = config.retrieval, Layout.of(workdir)
    rows = TABLE3
    fusion = (float(rcfg.fusion.w_img), float(rcfg.fusion.w_txt))
    if (layout.image_text / "manifest.json").is_file():
        w_txt = fusion[1] if fusion[1] != 0.0 else float(rcfg.fusion.compare_w_txt)
        rows += (FUSED.with_overrides(retrieval__fusion__w_txt=w_txt),)
        rows += (TEXT_CONVEX,) if fitted_pair(layout, "image_text") else ()
    if (layout.entity_text_match / "manifest.json").is_file():
        rows += (TEXT_MATCH,)
    if (layout.lexical / "manifest.json").is_file():
        rows += LEXICAL
        rows += (CONVEX,) if fitted_pair(layout, "bm25") else ()
    if (layout.reranker / "manifest.json").is_file() or rcfg.rerank.enabled:
        rows += (RERANK,)
        if fusion != (1.0, 0.0):
            rows += (FUSED_RERANK,)
    if not full_row_note(workdir):
        rows += (FULL,)
    return rows


def fitted_pair(layout: Layout, pair: str) -> bool:
    """Whether W/convex_fusion holds a weight for `pair` (a store that cannot be read: no row; its method says why)."""
    if not (layout.convex_fusion / "manifest.json").is_file():
        return False
    try:
        return FusionWeight.open(layout.convex_fusion).pair(pair) is not None
    except CfirError:
        return pair == "bm25"  # the row's method then names the damage in one line, as before


def full_row_note(workdir) -> str:
    """'' when the D-BEiT-3 Full row can run (W/model_full and W/image_cache_full exist, the cache of the model's
    tower), else the line saying which command makes or refreshes what it lacks."""
    layout = Layout.of(workdir)
    if not (layout.model_full / "manifest.json").is_file():
        return (f"D-BEiT-3 Full: no row, {layout.model_full} is not trained; make it with: python train.py --config "
                f"CONFIG:full --workdir {layout.root}, then python index.py --config CONFIG --workdir "
                f"{layout.root} --stages image_cache_full")
    if not (layout.image_cache_full / "manifest.json").is_file():
        return (f"D-BEiT-3 Full: no row, {layout.image_cache_full} is not built; make it with: python index.py "
                f"--config CONFIG --workdir {layout.root} --stages image_cache_full")
    if why := layout.full_cache_stale():
        return (f"D-BEiT-3 Full: no row, {layout.image_cache_full} is stale ({why}); refresh it with: python "
                f"index.py --config CONFIG --workdir {layout.root} --stages image_cache_full")
    return ""
