"""CFIR retrieval: entity ranking, summary re-ranking (CPU and device scorers), reports, query files."""
