"""The workdir's stores: their contract (manifests, atomic store directories: `contract`), checksums and --verify
(`integrity`), the workdir's paths (`layout`), the one-writer lock (`lock`), atomic file writes (`atomic_write`), and
the reader of every store (image cache, entities, summaries, entity index, image text, entity text match). Readers
open finished stores; what builds them lives in `cfir_jax.index`."""
