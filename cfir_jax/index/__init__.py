"""The offline builders: each stage's build (image cache, entities, summaries, entity index, image text, entity text
match), the chunked multi-host builds they share (`chunks`), the runner over the stages, a rebuild committed as one
version (`rebuild`), and how each store follows a change of the collection (each module registers its steps with
`store_update`; `collection_update` runs them: --add, --remove, --compact, --add-entities). Readers of the stores
they write are in `cfir_jax.stores`; nothing here imports training or retrieval."""
