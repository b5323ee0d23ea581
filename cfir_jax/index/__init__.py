"""The offline index: image embedding cache, entities, summaries, entity candidate index, and the runner."""
