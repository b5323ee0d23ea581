"""The stores index.py builds, each declared once, here in the builders' room: what it holds and what it is made
from. Each one's stage and its steps per change of the collection are beside its builder (`descriptor.Stage`, in the
module that builds it); this module stays light (no JAX), so the layout, `--verify` and the service read the
declarations without loading a builder."""

from __future__ import annotations

from cfir_jax.stores.layout import Directory, declare

declare(Directory("corpus", config="index.corpus",
                  about="the documents, the images and the qrels (cfir_jax.data.corpus)"))
declare(Directory("image_cache", made_from=("corpus",), config="index.image_cache",
                  about="[N, D] embeddings of the corpus' images (cfir_jax.stores.image_cache)"))
# Made from nothing the index rebuilds: a configured model, or W/encoder exported once by the caption pretraining (its
# stage keeps it), so rebuilding a store never makes it stale.
declare(Directory("encoder", made_from=("pretrain",), config="index.encoder",
                  about="the frozen encoder the index encodes text with, when index.py made it (synthetic worlds)"))
declare(Directory("entities", made_from=("corpus",), config="index.entities",
                  about="the named entities of every document (cfir_jax.stores.entities)"))
declare(Directory("summaries", made_from=("corpus",), config="index.summaries",
                  about="a summary of every document (cfir_jax.stores.summaries)"))
declare(Directory("entity_index", made_from=("entities", "image_cache", "encoder", "corpus"),
                  config="index.entity_index", about="the top-K images of every entity (cfir_jax.stores.entity_index)"))
declare(Directory("image_text", made_from=("image_cache", "encoder", "corpus"), config="index.image_text",
                  about="[N, D] embeddings of each cached image's own text, for fused SR (cfir_jax.stores.image_text)"))
declare(Directory("entity_text_match", made_from=("entity_index", "image_cache", "corpus"),
                  config="index.entity_text_match",
                  about="per entity, the images whose own text names it (cfir_jax.stores.entity_text_match)"))
declare(Directory("lexical", made_from=("image_cache", "corpus"), config="index.lexical",
                  about="BM25 over each cached image's own text (cfir_jax.stores.lexical)"))
declare(Directory("image_cache_full", made_from=("corpus", "model_full"),
                  about="the image cache encoded by W/model_full's vision tower (index.py --stages image_cache_full)"))
declare(Directory("image_fields", made_from=("image_cache", "corpus"), config="index.fields",
                  about="the images' own fields (date, source, ...) as typed columns, for filters "
                        "(cfir_jax.stores.image_fields)"))
declare(Directory("duplicates", made_from=("image_cache",), config="index.duplicates",
                  about="near-duplicate images as groups, folded at query time (cfir_jax.stores.duplicates)"))
