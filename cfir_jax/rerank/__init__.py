"""Fitting the third retrieval stage's re-ranker: the train split's SR lists from the Retriever, the head's fit
(its own small loop: AdamW, early stopping on held-out MRR@10), and the store W/reranker it writes."""
