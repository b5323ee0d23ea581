"""The workdir's stores: their contract (manifests, atomic store directories: `contract`), checksums and --verify
(`integrity`), the workdir's paths (`layout`), the one-writer lock (`lock`), atomic file writes (`atomic_write`), and
the reader of every store (image cache, entities, summaries, entity index, image text, entity text match, lexical),
with `readers`: those retrieval opens when a method or an option asks. Readers open finished stores; what builds them
lives in `cfir_jax.builders`."""
