"""The no-repeat n-gram rule of BART's beam search as a dense, static-shaped mask (jit- and TPU-friendly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def no_repeat_ngram_mask(sequences, cur_len, ngram_size: int, vocab_size: int):
    """Tokens that would repeat an n-gram already in the sequence: bool [rows, vocab_size].

    sequences: int [rows, max_length], generated up to `cur_len` (a traced scalar inside the generation loop). A token
    t is banned when the last n-1 tokens followed by t occur earlier. Dense and static-shaped, O(rows * max_length):
    transformers' Flax processor builds a sparse BCOO tensor that jax>=0.7 can no longer gather from.
    """
    n = ngram_size
    rows, length = sequences.shape
    windows = length - n + 1  # Start positions of n-grams.
    if windows < 1:
        return jnp.zeros((rows, vocab_size), bool)
    start = jnp.maximum(cur_len - (n - 1), 0)
    prefix = jax.lax.dynamic_slice(sequences, (0, start), (rows, n - 1))  # [rows, n - 1]
    match = jnp.arange(windows)[None, :] <= cur_len - n  # Only n-grams that are fully generated.
    for j in range(n - 1):
        match = match & (sequences[:, j : j + windows] == prefix[:, j : j + 1])
    following = sequences[:, n - 1 :]  # [rows, windows]: the token ending each n-gram.
    return jnp.zeros((rows, vocab_size), bool).at[jnp.arange(rows)[:, None], following].max(match)
