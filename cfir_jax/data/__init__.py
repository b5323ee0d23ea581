"""Corpora in the project's record format: AToMiC from its parquet files, and the synthetic world."""
