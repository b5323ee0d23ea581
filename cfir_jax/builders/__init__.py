"""The offline builders: each store's one declaration (`descriptor`: what it is made from, its stage, its steps per
change of the collection, its reader), beside its build (image cache, entities, summaries, entity index, image text,
entity text match, lexical), the chunked multi-host builds they share (`chunks`), the runner over the declared stages,
a rebuild committed as one version (`rebuild`), and the one loop over the declared stores that changes a collection
(`collection_update`: --add, --remove, --compact, --add-entities). Readers of the stores they write are in
`cfir_jax.stores`; nothing here imports training or retrieval."""
