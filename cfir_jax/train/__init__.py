"""Training the language expert: contrastive loss, mesh and parameter rules, the trainer, its data."""
