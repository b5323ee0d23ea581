"""Batch text encoding with a frozen text tower: strings -> L2-normalised embeddings, one compilation per batch size.

Used for entity texts (16 tokens) when indexing and at query time, and for summaries/documents (64 tokens) when
retrieving. Batches are padded to a fixed shape so encoding any number of strings compiles once.
`encode_with_tokens` also returns every token's output through the language head (the re-ranker's late interaction).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from cfir_jax.errors import CfirError
from cfir_jax.model.beit3 import DBeit3, TextTower
from cfir_jax.model.tokenizer import Beit3Tokenizer


class TextEncoder:
    """`encode(texts) -> [len(texts), D] float32`: tokenise, pad to `batch_size`, run the jitted text tower."""

    def __init__(self, model: DBeit3 | TextTower, tokenizer: Beit3Tokenizer, max_len: int, batch_size: int = 64):
        tower = model.text_tower() if isinstance(model, DBeit3) else model
        if tokenizer.vocab_size > tower.config.vocab_size:
            raise CfirError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids but the model's text "
                            f"embedding has {tower.config.vocab_size} rows: tokenizer and model do not belong together")
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.batch_size = batch_size
        self.dim = tower.config.embed_dim
        graphdef, state = nnx.split(tower)
        self._state = state

        @jax.jit
        def encode(state, ids, mask):
            return nnx.merge(graphdef, state).encode_text(ids, mask)

        self._encode = encode
        self._graphdef = graphdef
        self._encode_all = None  # compiled on the first encode_with_tokens

    def _batched(self, fn, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """fn(state, ids, mask) over [N, max_len] inputs in padded batches of batch_size -> [N, ...] float32."""
        parts = []
        for start in range(0, len(ids), self.batch_size):
            chunk_ids, chunk_mask = ids[start : start + self.batch_size], mask[start : start + self.batch_size]
            pad = self.batch_size - len(chunk_ids)
            if pad:
                chunk_ids = np.concatenate([chunk_ids, np.repeat(chunk_ids[-1:], pad, 0)])
                chunk_mask = np.concatenate([chunk_mask, np.repeat(chunk_mask[-1:], pad, 0)])
            parts.append(np.asarray(fn(self._state, chunk_ids, chunk_mask), np.float32)[: self.batch_size - pad])
        return np.concatenate(parts)

    def encode_tokens(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids/mask [N, max_len] -> [N, D] float32."""
        if len(ids) == 0:
            return np.zeros((0, self.dim), np.float32)
        return self._batched(self._encode, ids, mask)

    def encode_with_tokens(self, texts: Sequence[str]) -> tuple[np.ndarray, list[np.ndarray]]:
        """texts [N] -> (embeddings [N, D], per text its tokens' outputs [T_i, D]), all float32 and L2-normalised.

        Every token's final state goes through the language head, as the embedding's first token does: the tokens
        live in the joint space the images do. A text's tokens are its non-padding ones after the first (the first
        is the embedding itself).
        """
        if self._encode_all is None:
            graphdef = self._graphdef

            @jax.jit
            def encode_all(state, ids, mask):
                return nnx.merge(graphdef, state).encode_text_tokens(ids, mask)

            self._encode_all = encode_all
        if len(texts) == 0:
            return np.zeros((0, self.dim), np.float32), []
        ids, mask = self.tokenizer(list(texts), self.max_len)
        states = self._batched(self._encode_all, ids, mask)  # [N, L, D]
        keep = ~np.asarray(mask, bool)
        keep[:, 0] = False
        return states[:, 0], [s[k] for s, k in zip(states, keep)]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """texts [N] -> [N, D] float32 (N may be 0)."""
        if len(texts) == 0:
            return np.zeros((0, self.dim), np.float32)
        ids, mask = self.tokenizer(list(texts), self.max_len)
        return self.encode_tokens(ids, mask)
