"""The offline builders: each stage's build (image cache, entities, summaries, entity index, image text, entity text
match), the chunked multi-host builds they share (`chunks`), and the runner over the stages. Readers of the stores
they write are in `cfir_jax.stores`; nothing here imports training or retrieval."""
