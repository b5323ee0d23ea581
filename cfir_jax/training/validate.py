"""Validation during training: R@1/5/10 and MRR@10 of the text tower by exact search over the validation images."""

from __future__ import annotations

import jax
import jax.experimental.multihost_utils
import numpy as np

from cfir_jax.eval.metrics import evaluate as trec_evaluate
from cfir_jax.training.data import EvalData


def evaluate(encoder, params, frozen, eval_data: EvalData, batch_size: int, mesh) -> dict[str, float]:
    """R@1/5/10 and MRR@10 of the validation queries by exact search over the validation images."""
    q = len(eval_data.query_ids)
    n_dev = mesh.size
    batch_size = max(n_dev, (batch_size // n_dev) * n_dev)
    embs = []
    for start in range(0, q, batch_size):
        ids = eval_data.ids[start : start + batch_size]
        mask = eval_data.padding_mask[start : start + batch_size]
        pad = batch_size - len(ids)
        if pad:
            ids = np.concatenate([ids, np.repeat(ids[-1:], pad, 0)])
            mask = np.concatenate([mask, np.repeat(mask[-1:], pad, 0)])
        out = encoder(params, frozen, ids, mask)
        embs.append(np.asarray(jax.device_get(out))[: batch_size - pad])
    text = np.concatenate(embs)
    scores = text @ np.asarray(eval_data.image_embeddings, np.float32).T
    k = min(10, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    run = {}
    for qi, qid in enumerate(eval_data.query_ids):
        run[qid] = {eval_data.image_ids[j]: float(scores[qi, j]) for j in top[qi]}
    result = trec_evaluate(run, eval_data.qrels, measures=("recall@1", "recall@5", "recall@10", "mrr@10"))
    return {f"val/{k.replace('@', '_at_')}": v for k, v in result.aggregate.items()}
