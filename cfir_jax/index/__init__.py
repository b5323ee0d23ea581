"""The offline builders: each stage's build (image cache, entities, summaries, entity index, image text, entity text
match), the chunked multi-host builds they share (`chunks`), the runner over the stages, and the new versions of
the data stores a change of the collection stages (`store_updates`: --add, --remove, --compact). Readers of the stores
they write are in `cfir_jax.stores`; nothing here imports training or retrieval."""
