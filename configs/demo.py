"""The demo: the whole CFIR pipeline on a synthetic world, on a laptop CPU, in minutes (no downloads).

  python index.py    --config configs/demo.py --workdir demo_work   # world, cache, caption pretraining, entities,
                                                                    # summaries, entity index
  python train.py    --config configs/demo.py --workdir demo_work   # CFIR: language expert on summaries
  python retrieve.py --config configs/demo.py --index demo_work --query examples/doc.txt
  python retrieve.py --config configs/demo.py --index demo_work --evaluate test

`configs/demo.py:full` is the D-BEiT-3 Full baseline on the demo world (issue 22): the same tiny model with both
towers trained from the world's images (64 px here, 16 patches) and the documents' text, from the seed, at CPU
scale: batch 64, 300 steps, lr 6e-4 (at 1e-3 it collapsed to the uniform loss, log 64), about 75 s on 2 cores
(README, "D-BEiT-3 Full"). It needs only W/corpus (index.py's first stage) and writes W/train_full and
W/model_full, never W/train or W/model:

  python train.py    --config configs/demo.py:full --workdir demo_work

`configs/demo.py:multilingual` writes 15% of the world's documents and captions in French (spaCy's French pipeline,
`pip install -e ".[lang-fr]"`) and 10% in Indonesian (no pipeline here: the fallback rule), which index.py detects;
`--compare` then adds the rows per language (docs/languages.md):

  python index.py    --config configs/demo.py:multilingual --workdir demo_ml

`configs/demo.py:tiny` is the same on a 40-document world (tests). The world's images come with embeddings (the
frozen image tower's output stands in for BEiT-3's), and no pretrained text weights exist for it, so index.py first
trains the text tower on image captions (as BEiT-3's itc pretraining did) and freezes that as the entity encoder.
Expected (default size): CFIR well above dense document and summary search on the test split (see README).
"""

from cfir_jax.core.variants import parse_arg
from configs.base import experiment


def get_config(arg=None):
    variant = parse_arg(arg, tiny=False, full=False, multilingual=False)  # in any order: `:full,tiny` is `:tiny,full`
    tiny, full = variant.tiny, variant.full
    cfg = experiment("base", "runlocal,full" if full else "runlocal")
    # The demo's own recipe, tuned for a 2-layer model on a synthetic world: no drop path, no layer-wise lr decay.
    # The world's sentencepiece holds ~700 pieces in English, ~1,150 with French and Indonesian words (multilingual).
    cfg.model.update(embed_dim=64, num_layers=2, num_heads=4, ffn_dim=256,
                     vocab_size=2048 if variant.multilingual else 1024, max_text_positions=512, dropout=0.0,
                     drop_path_rate=0.0)
    cfg.index.corpus.update(source="synthetic", synthetic_size="tiny" if tiny else "default",
                            synthetic_languages="fr:0.15,id:0.1" if variant.multilingual else "")
    cfg.index.encoder = "pretrain"
    cfg.index.image_cache.update(precomputed="corpus", dtype="float16")
    cfg.index.summaries.update(summarizer="extractive", extractive_tokens=48)
    cfg.index.entity_index.update(k=20 if tiny else 200, backend="exact", max_text_len=16, encode_batch=64)
    # Beyond the paper: the world's image-side text embedded for the fused SR row of --compare.
    cfg.index.image_text.update(enabled=True, max_text_len=32, encode_batch=64)
    # Beyond the paper: entities matched against that text, for the entity text match row of --compare.
    cfg.index.entity_text_match.enabled = True
    # Beyond the paper: BM25 over that text (W/lexical), for the BM25 rows of --compare.
    cfg.index.lexical.enabled = True
    # Caption pretraining of the text tower (the stand-in for BEiT-3's image-text pretraining).
    cfg.index.pretrain = dict(global_batch=32 if tiny else 128, num_steps=30 if tiny else 400, lr=2e-3,
                              warmup_steps=5 if tiny else 40, max_text_len=32, log_every=10, eval_every=10**9,
                              checkpoint_every=10**9)
    cfg.train.update(text="summary", max_text_len=64, global_batch=32 if tiny else 128,
                     num_steps=20 if tiny else 300, lr=1e-3, warmup_steps=5 if tiny else 30, layer_decay=1.0,
                     log_every=10, eval_every=10 if tiny else 100, checkpoint_every=10 if tiny else 100, eval_batch=128)
    if full:  # D-BEiT-3 Full at CPU scale: both towers from 64 px images and the documents' text, from the seed
        cfg.model.update(image_size=32 if tiny else 64, remat=False)
        cfg.train.update(text="document", init_model="", global_batch=16 if tiny else 64, num_steps=4 if tiny else 300,
                         lr=6e-4, warmup_steps=2 if tiny else 30, log_every=2 if tiny else 30,
                         checkpoint_every=2 if tiny else 100)
    cfg.retrieval.update(top_k=100 if tiny else 1000)
    # Beyond the paper (off): the re-ranker reads the document at the model's 510 usable text positions.
    cfg.retrieval.rerank.update(max_text_len=510)
    return cfg
