"""Batch text encoding with a frozen text tower: strings -> L2-normalised embeddings, one compilation per batch size.

Used for entity texts (16 tokens) when indexing and at query time, and for summaries/documents (64 tokens) when
retrieving. Batches are padded to a fixed shape so encoding any number of strings compiles once.
`encode_against` also compares every token's output with given images (the re-ranker's late interaction).

The jitted programs take the weights as an argument and are shared by every encoder of a tower of equal structure
(its nnx graph: the architecture, not the weights), so a model opened again (the service's reload, an `Index`
reopened after a change) traces and compiles nothing: a reload of the demo's front spent most of its time there.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cfir_jax.core.errors import CfirError
from cfir_jax.model import program_cache
from cfir_jax.model.beit3 import DBeit3, TextTower
from cfir_jax.model.program_cache import DiskProgram
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
        graphdef, self._state = nnx.split(tower)
        self._encode, self._encode_against = _programs(graphdef)

    def _batched(self, fn, *arrays: np.ndarray) -> list[np.ndarray]:
        """fn(state, *batch) over row-aligned arrays [N, ...] in batches padded to batch_size -> its outputs, each
        [N, ...] float32 (one compilation whatever N)."""
        outputs = []
        for start in range(0, len(arrays[0]), self.batch_size):
            chunk = [a[start : start + self.batch_size] for a in arrays]
            pad = self.batch_size - len(chunk[0])
            if pad:
                chunk = [np.concatenate([c, np.repeat(c[-1:], pad, 0)]) for c in chunk]
            out = fn(self._state, *chunk)
            outputs.append([np.asarray(o, np.float32)[: self.batch_size - pad]
                            for o in (out if isinstance(out, tuple) else (out,))])
        return [np.concatenate(parts) for parts in zip(*outputs)]

    def encode_tokens(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids/mask [N, max_len] -> [N, D] float32."""
        if len(ids) == 0:
            return np.zeros((0, self.dim), np.float32)
        return self._batched(self._encode, ids, mask)[0]

    def encode_against(self, texts: Sequence[str], images: np.ndarray, top: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Late interaction: texts [B], images [B, N, D] (each text's own candidates) -> (embeddings [B, D],
        best [B, N], top_mean [B, N]) float32: for each image, the best similarity of one of the text's tokens with it
        and the mean of the `top` best (all of them when the text has fewer; 0 when it has none).

        Every token's final state goes through the language head and L2 normalisation as the embedding's first token
        does (`TextTower.encode_text_tokens`), so tokens and images share the joint space. A text's tokens are its
        non-padding ones after the first, which is the embedding itself. The similarities stay on the device: only
        [B, N] numbers per statistic come back, never the [B, L, D] token states.
        """
        if len(texts) == 0:
            return np.zeros((0, self.dim), np.float32), *np.zeros((2, 0, images.shape[1]), np.float32)
        ids, mask = self.tokenizer(list(texts), self.max_len)
        fn = functools.partial(self._encode_against, top=int(top))
        embeddings, best, top_mean = self._batched(fn, ids, mask, np.asarray(images, np.float32))
        return embeddings, best, top_mean

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """texts [N] -> [N, D] float32 (N may be 0)."""
        if len(texts) == 0:
            return np.zeros((0, self.dim), np.float32)
        ids, mask = self.tokenizer(list(texts), self.max_len)
        return self.encode_tokens(ids, mask)


def _programs(graphdef: nnx.GraphDef) -> tuple[Callable, Callable]:
    """The jitted (encode, encode_against) of a tower of this structure, made once per structure in a process
    (`program_cache.memo`); equal structures merge any tower's weights alike."""
    identity = _structure(graphdef)
    return program_cache.memo("text-programs", identity, lambda: _compile(graphdef, identity))


def _compile(graphdef: nnx.GraphDef, identity: str) -> tuple[Callable, Callable]:
    @jax.jit
    def encode(state, ids, mask):
        return nnx.merge(graphdef, state).encode_text(ids, mask)

    @functools.partial(jax.jit, static_argnames="top")
    def encode_against(state, ids, mask, images, top):
        tokens = nnx.merge(graphdef, state).encode_text_tokens(ids, mask)  # [B, L, D]
        keep = ~mask.astype(bool) & (jnp.arange(ids.shape[1]) > 0)  # the text's own tokens after the first
        sims = jnp.where(keep[:, None, :], jnp.einsum("bnd,bld->bnl", images, tokens), -jnp.inf)  # [B, N, L]
        best = jax.lax.top_k(sims, min(top, ids.shape[1]))[0]  # [B, N, m], best first
        m = jnp.minimum(top, keep.sum(axis=1))[:, None, None]  # fewer tokens than `top`: all of them
        among = jnp.arange(best.shape[-1]) < m
        top_mean = jnp.where(among, best, 0.0).sum(axis=-1) / jnp.maximum(m[..., 0], 1)
        return tokens[:, 0], jnp.where(m[..., 0] > 0, best[..., 0], 0.0), top_mean

    return (DiskProgram(encode, "text-encode", identity, _CODE),
            DiskProgram(encode_against, "text-encode-against", identity, _CODE))


_CODE = ("cfir_jax.model",)  # the source that defines the programs: the tower's layers and these functions


def _structure(graphdef: nnx.GraphDef) -> str:
    """The tower's structure as text, the same in every process (the functions it names without their addresses)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(graphdef))
