"""Training a sentencepiece model with BEiT-3's ids (<unk>=0 <s>=1 </s>=2, no pad): the tokenizer a synthetic world
ships (`cfir_jax.data.synthetic`), read by `cfir_jax.model.tokenizer` like beit3.spm. It stands on the floor both the
data and the model stand on, so neither imports the other for it."""

from __future__ import annotations

import io
import os
from pathlib import Path


def train_tokenizer(texts: list[str], path: str | os.PathLike, vocab_size: int, seed: int = 0) -> int:
    """Trains a sentencepiece unigram model on `texts` with beit3.spm's ids (<unk>=0 <s>=1 </s>=2, no pad).

    `vocab_size` is an upper bound: the synthetic lexicon (~1,100 distinct words) supports only ~700 unigram
    pieces, and sentencepiece stops there. Returns the size reached.
    """
    # why: sentencepiece loads only when a tokenizer is opened or trained
    import sentencepiece as spm

    # Sentences, not whole documents: sentencepiece skips inputs longer than max_sentence_length bytes.
    sentences = [s.strip() for t in texts for s in t.split(". ") if s.strip()]
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        character_coverage=1.0,
        hard_vocab_limit=False,  # a tiny world has fewer pieces than the vocab asked for
        num_threads=1,  # one thread: the same seed must give the same model
        minloglevel=2,
    )
    Path(path).write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size()
