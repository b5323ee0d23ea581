"""The synthetic world's caption pretraining: the text tower trained on (caption, image) pairs, exported as
W/encoder, standing in for BEiT-3's itc weights (index.encoder='pretrain').

It is training, so it lives here; the index command passes it to the index runner's encoder stage
(`cfir_jax.builders.runner.build_index(..., pretrain=pretrain_encoder)`), and builders/ never imports training/.
"""

from __future__ import annotations

from cfir_jax.core import hosts
from cfir_jax.stores.atomic_write import replace_dir
from cfir_jax.stores.layout import Layout
from cfir_jax.training import loop
from cfir_jax.training.data import load_train_data
from cfir_jax.training.tasks import TextTask


def pretrain_encoder(config, layout: Layout) -> None:
    """Trains the text tower on the captions of `layout`'s corpus (config.index.pretrain's train settings) and
    publishes it as W/encoder, once, atomically (the export is complete before the rename)."""
    pre = config.copy_and_resolve_references()
    pre.train.update(dict(config.index.get("pretrain", {})))
    pre.train.text = "caption"
    pre.train.export_model = "scratch"
    pre.train.init_model = ""
    data = load_train_data(pre, layout.root, with_eval=False)
    loop.run(pre, layout.pretrain, TextTask(data, "caption pretraining"))  # every process: the multi-host loop
    hosts.barrier("encoder_exported")
    if hosts.is_main():
        replace_dir(layout.pretrain / "model", layout.encoder)
    hosts.barrier("encoder_published")
