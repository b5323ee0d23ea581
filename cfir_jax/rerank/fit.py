"""Fitting the re-ranker (`python retrieve.py --index W --fit-reranker`) on the train split's own SR lists, and
writing the store W/reranker that `cfir_jax.retrieve.reranker` opens.

For every train document (at most `retrieval.rerank.max_train_docs`, a seeded sample), the trained model's SR top-N
with the features of `cfir_jax.retrieve.rerank_features`; a candidate is positive when the train qrels judge it
relevant. Lists without a positive in their top-N are skipped, not patched by appending the missing positives: at
query time the re-ranker can only reorder the top-N, and an appended positive would carry features (an SR score
below the list's, no rank) that only positives have, a shortcut the test lists never offer. A seeded slice of the
kept lists (`heldout`) is held out; the head is fitted with AdamW on the list-wise softmax loss
(`cfir_jax.model.rerank_head.listwise_loss`) and the epoch with the best held-out MRR@10 is kept (early stopping
after `patience` epochs without a gain). The entity index holds the train documents' own entities, so their ER
lists are the ones a test document with only known entities would get; test documents with unseen entities get
searched lists the fit never sees.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from cfir_jax.api.index import Index
from cfir_jax.core.config_upgrade import upgrade
from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import bar
from cfir_jax.model.rerank_head import RerankHead, Standardisation, listwise_loss
from cfir_jax.retrieve.reranker import FORMAT_VERSION, KIND
from cfir_jax.stores.contract import atomic_dir, write_manifest
from cfir_jax.stores.layout import Layout


@dataclasses.dataclass
class FitSettings:
    """How the head is fitted (retrieval.rerank's fitting fields)."""

    hidden: int = 32
    lr: float = 3e-3
    weight_decay: float = 1e-4
    batch_lists: int = 64
    max_epochs: int = 200
    patience: int = 15
    seed: int = 0

    @classmethod
    def of(cls, rerank: ml_collections.ConfigDict) -> FitSettings:
        return cls(**{f.name: type(f.default)(rerank[f.name]) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class FitResult:
    head: RerankHead
    best_epoch: int
    epochs: int
    heldout_mrr: float  # MRR@10 of the re-ranked held-out lists at the best epoch
    heldout_sr_mrr: float  # the same lists in SR's order


def list_mrr(logits: np.ndarray, valid: np.ndarray, labels: np.ndarray, cut: int = 10) -> float:
    """Mean reciprocal rank of the first positive within each list, cut at `cut` (logits/valid/labels [Q, N]);
    ties keep the list's order (SR's)."""
    if len(logits) == 0:
        return 0.0
    order = np.argsort(-np.where(valid, logits, -np.inf), axis=1, kind="stable")
    ranked = np.take_along_axis(labels & valid, order, axis=1)[:, :cut]
    first = np.where(ranked.any(axis=1), ranked.argmax(axis=1), -1)
    return float(np.mean(np.where(first >= 0, 1.0 / np.maximum(first + 1, 1), 0.0)))


def fit_head(features: np.ndarray, valid: np.ndarray, labels: np.ndarray, train: np.ndarray, heldout: np.ndarray,
             settings: FitSettings, progress: bool | None = None) -> FitResult:
    """Fits a RerankHead on lists `train` of features [Q, N, F] (valid, labels [Q, N] bool) and keeps the epoch
    whose MRR@10 on lists `heldout` is best; deterministic for a given seed. progress: a bar over the epochs."""
    if len(train) == 0 or len(heldout) == 0:
        raise CfirError(f"re-ranker: {len(train)} training and {len(heldout)} held-out lists with a positive in "
                        "SR's top-N; it needs at least one of each (more train documents, or a larger top_n)")
    head = RerankHead(features.shape[-1], settings.hidden, rngs=nnx.Rngs(settings.seed))
    seen = features[train][valid[train]]  # [M, F] every training candidate
    std = seen.std(axis=0)
    head.shift.value = jnp.asarray(seen.mean(axis=0))
    head.scale.value = jnp.asarray(np.where(std > 1e-6, 1.0 / np.maximum(std, 1e-6), 1.0), jnp.float32)
    graphdef, params, stats = nnx.split(head, nnx.Param, Standardisation)
    tx = optax.adamw(settings.lr, weight_decay=settings.weight_decay)
    opt_state = tx.init(params)

    def logits_of(params, x, v):
        return nnx.merge(graphdef, params, stats)(x, v)

    @jax.jit
    def step(params, opt_state, x, v, y):
        loss, grads = jax.value_and_grad(lambda p: listwise_loss(logits_of(p, x, v), v, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    score = jax.jit(logits_of)
    held = (features[heldout], valid[heldout], labels[heldout])

    def heldout_mrr(params) -> float:
        return list_mrr(np.asarray(score(params, held[0], held[1])), held[1], held[2])

    rng = np.random.default_rng(settings.seed)
    batch = max(1, min(settings.batch_lists, len(train)))
    best_mrr, best_params, best_epoch, stale, epoch = -1.0, params, 0, 0, 0
    epochs = bar(total=settings.max_epochs, desc="re-ranker", unit="epoch", show=progress)
    for epoch in range(1, settings.max_epochs + 1):
        order = rng.permutation(train)
        order = np.concatenate([order, order[: (-len(order)) % batch]])  # whole batches: one compilation
        for b in range(0, len(order), batch):
            idx = order[b : b + batch]
            params, opt_state, _ = step(params, opt_state, features[idx], valid[idx], labels[idx])
        mrr = heldout_mrr(params)
        epochs.update(1)
        epochs.set_postfix(heldout_mrr10=f"{mrr:.4f}")
        if mrr > best_mrr:
            best_mrr, best_params, best_epoch, stale = mrr, params, epoch, 0
        else:
            stale += 1
            if stale >= settings.patience:
                break
    epochs.close()
    sr_mrr = list_mrr(-np.arange(features.shape[1], dtype=np.float32)[None].repeat(len(heldout), 0), *held[1:])
    return FitResult(nnx.merge(graphdef, best_params, stats), best_epoch, epoch, best_mrr, sr_mrr)


def fit_reranker(config: ml_collections.ConfigDict, workdir, progress: bool = True) -> dict:
    """Fits the re-ranker on the train split of `workdir` and writes `W/reranker`; returns its manifest."""
    start = time.time()
    cfg = upgrade(config.copy_and_resolve_references())
    rerank = cfg.retrieval.rerank
    top_n = int(rerank.top_n)  # at least 2, and heldout a fraction (cfir_jax.core.config_check)
    # SR exactly (the paper's), as evaluation scores it; the lists stop at N; the stage itself stays off.
    cfg.retrieval.update(sr=cfg.retrieval.eval_sr, top_k=top_n)
    rerank.enabled = False
    index = Index(cfg, workdir, "cfir", rerank_features=True)  # the features in each answer
    qrels = index.qrels("train")  # one line when the corpus has no train split to fit on
    docs = index.corpus_documents("train")
    rng = np.random.default_rng(int(rerank.seed))
    if 0 < int(rerank.max_train_docs) < len(docs):
        docs = [docs[i] for i in np.sort(rng.choice(len(docs), int(rerank.max_train_docs), replace=False))]
    results = index.retrieve(docs, progress=progress)
    inputs = index.reranker_inputs()
    num_features = len(inputs["features"])
    features = np.zeros((len(docs), top_n, num_features), np.float32)
    valid = np.zeros((len(docs), top_n), bool)
    labels = np.zeros((len(docs), top_n), bool)
    for q, (doc, result) in enumerate(zip(docs, results)):
        n = len(result.rerank_features)
        features[q, :n], valid[q, :n] = result.rerank_features, True
        relevant = qrels.get(doc.doc_id, {})
        labels[q, :n] = [relevant.get(h.id, 0) > 0 for h in result.hits[:n]]
    kept = np.flatnonzero(labels.any(axis=1))
    kept = rng.permutation(kept)
    num_heldout = max(1, round(float(rerank.heldout) * len(kept))) if len(kept) > 1 else 0
    fit = fit_head(features, valid, labels, np.sort(kept[num_heldout:]), np.sort(kept[:num_heldout]),
                   FitSettings.of(rerank), progress=None if progress else False)
    return save_reranker(
        Layout.of(workdir).reranker, fit.head, inputs["features"],
        **{key: int(rerank[key]) for key in ("top_n", "max_text_len", "li_top")},
        sources=inputs["sources"], sr_fusion=inputs["sr_fusion"], seed=int(rerank.seed),
        train_documents=len(docs), lists_kept=int(len(kept)), lists_skipped=int(len(docs) - len(kept)),
        heldout_lists=int(num_heldout), heldout_mrr10=round(fit.heldout_mrr, 4),
        heldout_sr_mrr10=round(fit.heldout_sr_mrr, 4), best_epoch=fit.best_epoch, epochs_run=fit.epochs,
        fit_seconds=round(time.time() - start, 1))


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = np.asarray(value)
    return out


def save_reranker(path: str | os.PathLike, head: RerankHead, features: tuple[str, ...], **fields: Any) -> dict:
    """Writes the store atomically (a temporary directory renamed into place); returns its manifest."""
    with atomic_dir(path) as tmp:
        np.savez(tmp / "params.npz", **_flatten(nnx.to_pure_dict(nnx.state(head))))
        hidden = int(head.fc2.in_features)
        return write_manifest(tmp, KIND, FORMAT_VERSION, features=list(features), hidden=hidden, **fields)



def summary(m: dict, workdir) -> str:
    """What a fit did, in three lines (retrieve.py --fit-reranker): lists kept, held-out MRR@10 before and after,
    where the store went."""
    return "\n".join((
        f"re-ranker: {m['lists_kept']:,} of {m['train_documents']:,} train documents have a positive in SR's top "
        f"{m['top_n']} ({m['lists_skipped']:,} skipped); features {', '.join(m['features'])}",
        f"held-out lists: {m['heldout_lists']:,}, MRR@10 within the top {m['top_n']}: SR {m['heldout_sr_mrr10']:.4f}"
        f" -> re-ranked {m['heldout_mrr10']:.4f} (best epoch {m['best_epoch']} of {m['epochs_run']}); "
        f"{m['fit_seconds']:.1f} s",
        f"wrote {str(workdir).rstrip('/')}/reranker; use it with --config.retrieval.rerank.enabled=true "
        "(--compare adds its row)"))
