"""Evaluation: trec_eval-identical metrics and TREC run/qrels files."""
