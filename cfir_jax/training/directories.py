"""The directories of the workdir that training makes, each declared once, here in the training room: each run's
directory (checkpoints, metrics, its config: `cfir_jax.training.runs`, `cfir_jax.training.pretrain`) and the model
it exports. Light (no JAX), so the layout, `--verify` and the service read them without loading the trainer."""

from __future__ import annotations

from cfir_jax.stores.layout import RUN, Directory, declare

_RETRAIN = "train.py --config CONFIG --workdir W (after removing W/train, or it resumes the old run)"

# A rebuild links the caption pretraining's run: W/encoder is its export, and a rebuild resumes nothing else of it.
declare(Directory("pretrain", RUN, made_from=("corpus", "image_cache"), linked=True,
                  about="the caption pretraining run that produced W/encoder (synthetic worlds)"))
declare(Directory("train", RUN, made_from=("summaries", "image_cache", "encoder"),
                  about="the text tower's training run on (summary, image) pairs"))
declare(Directory("model", made_from=("summaries", "image_cache", "encoder", "train"), linked=True, refresh=_RETRAIN,
                  about="the trained model: the encoder's vision tower and the trained language expert"))
declare(Directory("train_document", RUN, made_from=("corpus", "image_cache", "encoder"),
                  about="the document baseline's training run (train.text=document)"))
declare(Directory("model_document", made_from=("train_document",),
                  about="the document baseline's model (the paper's \"document only\" row, Table 3)"))
declare(Directory("train_full", RUN, made_from=("corpus",),
                  about="D-BEiT-3 Full's training run, both towers from pixels (train.images=pixels)"))
# A rebuild links it: W/image_cache_full is encoded by its vision tower.
declare(Directory("model_full", made_from=("train_full",), linked=True,
                  about="the Full model (both towers trained; its manifest says trained=\"full\")"))
