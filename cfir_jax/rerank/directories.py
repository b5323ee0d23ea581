"""The re-ranker's directory of the workdir, declared once beside its fit (`cfir_jax.rerank.fit`). Light (no JAX)."""

from __future__ import annotations

from cfir_jax.stores.layout import Directory, declare

declare(Directory("reranker", made_from=("entity_index", "image_text", "model"),
                  refresh="retrieve.py --index W --fit-reranker",
                  about="the fitted re-ranker of SR's top N, beyond the paper (cfir_jax.retrieve.reranker)"))
declare(Directory("convex_fusion", made_from=("lexical", "entity_index", "model"),
                  refresh="retrieve.py --index W --fit-fusion",
                  about="the fitted weight of the convex fusion of SR and BM25, beyond the paper "
                        "(cfir_jax.stores.convex_fusion)"))
