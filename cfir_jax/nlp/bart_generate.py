"""BART's beam search with a real cache: the encoder and every decoder layer's cross-attention keys and values once
per document, the beams' queries broadcast over them, the self-attention keys and values in a static cache.

`make_generate(model_config, settings)` gives a pure function (state, input_ids [docs, src], attention_mask) ->
token ids [docs, max_length] (the best hypothesis, starting with the decoder start token, padded after its EOS),
for jit (`nlp.summarizer` runs it data parallel; `aot.programs` compiles it for TPUs).

The search is transformers' `generate(num_beams=...)`, token for token, in one of two flavours (`semantics`):
- "torch": `GenerationMixin._beam_search` (PyTorch, what CFIR ran): of the 2 x num_beams best continuations only
  the top num_beams may finish a hypothesis, hypotheses reaching max_length are scored with the finished ones, and a
  document whose running beams can no longer beat its finished ones takes no new hypothesis. A document's summary
  does not depend on the other documents of its batch.
- "flax": `FlaxGenerationMixin._beam_search`: any of the 2 x num_beams may finish, running hypotheses are returned
  only where none finished, the loop stops when no document can improve, and min_length also bans EOS at
  cur_len == min_length.
Both apply, in this order, the no-repeat n-gram rule (`no_repeat_ngram_mask`), min_length, the forced BOS at the
first step and the forced EOS at the last, to the log-softmax of the logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cfir_jax.core.errors import CfirError
from cfir_jax.nlp.ngram import no_repeat_ngram_mask

_FLAT_NEG = {"torch": -1e9, "flax": -1e7}  # each implementation's "impossible" score


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    max_length: int
    min_length: int
    num_beams: int
    length_penalty: float
    no_repeat_ngram_size: int
    early_stopping: bool | str
    decoder_start_token_id: int
    eos_token_id: int
    pad_token_id: int
    forced_bos_token_id: int | None
    forced_eos_token_id: int | None
    semantics: str = "torch"

    def __post_init__(self):
        if self.semantics not in _FLAT_NEG:
            raise CfirError(f"beam search semantics={self.semantics!r}: use torch or flax")


def _process(log_probs, sequences, cur_len, s: GenerationSettings):
    """The logits processors on log_probs [rows, vocab] (float32); sequences [rows, max_length]."""
    vocab = log_probs.shape[-1]
    if s.no_repeat_ngram_size > 0:
        log_probs = jnp.where(no_repeat_ngram_mask(sequences, cur_len, s.no_repeat_ngram_size, vocab), -jnp.inf,
                              log_probs)
    short = cur_len <= s.min_length if s.semantics == "flax" else cur_len < s.min_length
    log_probs = jnp.where(short & (jnp.arange(vocab) == s.eos_token_id), -jnp.inf, log_probs)
    for token, when in ((s.forced_bos_token_id, cur_len == 1), (s.forced_eos_token_id, cur_len == s.max_length - 1)):
        if token is not None:
            forced = jnp.where(jnp.arange(vocab) == token, 0.0, -jnp.inf)
            log_probs = jnp.where(when, forced[None, :], log_probs)
    return log_probs


def _gather(x, index):
    """x [docs, k, ...] at index [docs, n] along axis 1."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _penalties(s: GenerationSettings):
    """length ** length_penalty for every length 0..max_length, as the reference computes it: PyTorch in Python
    floats (rounded to float32 once), Flax in float32."""
    lengths = np.arange(s.max_length + 1, dtype=np.float64)
    if s.semantics == "flax":
        return jnp.asarray(lengths, jnp.float32) ** jnp.float32(s.length_penalty)
    return jnp.asarray((lengths ** s.length_penalty).astype(np.float32))


def _select(state, log_probs, s: GenerationSettings, penalties):
    """One beam-search update from the step's processed log-probs [docs, beams, vocab]: the new running beams (and
    the beam each came from), and the finished hypotheses merged with the ones that just ended."""
    docs, beams, vocab = log_probs.shape
    neg, cur = _FLAT_NEG[s.semantics], state["cur_len"]
    total = (log_probs + state["running_scores"][:, :, None]).reshape(docs, beams * vocab)
    top_lp, top_idx = jax.lax.top_k(total, 2 * beams)
    origin, token = top_idx // vocab, top_idx % vocab
    top_seq = _gather(state["running"], origin).at[:, :, cur].set(token)
    ended = token == s.eos_token_id
    if s.semantics == "torch":
        ended = ended | (cur + 1 >= s.max_length)
    order = jax.lax.top_k(top_lp + ended * neg, beams)[1]
    finish = ended & (jnp.arange(2 * beams) < beams) if s.semantics == "torch" else ended
    scored = top_lp / penalties[cur]  # cur + 1 - the decoder prompt's 1 token
    full = jnp.all(state["finished"], axis=-1, keepdims=True) & (s.early_stopping is True)
    if s.semantics == "torch":  # each reason adds its own -1e9, as PyTorch does
        scored = scored + full * neg + ~state["open"] * neg + ~finish * neg
    else:
        scored = scored + (full | ~finish) * neg
    merged = jax.lax.top_k(jnp.concatenate([state["scores"], scored], axis=1), beams)[1]
    return {
        "running": _gather(top_seq, order), "running_scores": _gather(top_lp + ended * neg, order),
        "sequences": _gather(jnp.concatenate([state["sequences"], top_seq], axis=1), merged),
        "scores": _gather(jnp.concatenate([state["scores"], scored], axis=1), merged),
        "finished": _gather(jnp.concatenate([state["finished"], finish], axis=1), merged),
        "all_ended": jnp.all(ended), "cur_len": cur + 1, "open": state["open"],
    }, _gather(origin, order)


def _still_open(state, s: GenerationSettings, penalties):
    """Per document: can a running beam still beat the worst finished hypothesis (transformers' heuristic)?"""
    neg = _FLAT_NEG[s.semantics]
    length = s.max_length - 1 if s.early_stopping == "never" and s.length_penalty > 0.0 else state["cur_len"] - 1
    best = state["running_scores"][:, :1] / penalties[length]
    worst = jnp.where(state["finished"], jnp.min(state["scores"], axis=1, keepdims=True), neg)
    return jnp.any(best > worst, axis=-1, keepdims=True)


def _keep_going(state, s: GenerationSettings, penalties):
    """The loop's condition, as each implementation evaluates it."""
    closed = jnp.all(state["finished"]) & (s.early_stopping is True)
    if s.semantics == "flax":  # Flax takes the first step before its loop
        improve = jnp.any(_still_open(state, s, penalties))
        return (state["cur_len"] < s.max_length) & ((state["cur_len"] == 1) | (~closed & improve))
    return (state["cur_len"] < s.max_length) & ~closed & jnp.any(state["open"]) & ~state["all_ended"]


def _initial_state(docs: int, s: GenerationSettings):
    b, neg = s.num_beams, _FLAT_NEG[s.semantics]
    running = jnp.full((docs, b, s.max_length), s.pad_token_id, jnp.int32).at[:, :, 0].set(s.decoder_start_token_id)
    return {"running": running, "running_scores": jnp.tile(jnp.array([0.0] + [neg] * (b - 1), jnp.float32), (docs, 1)),
            "sequences": running, "scores": jnp.full((docs, b), neg, jnp.float32),
            "finished": jnp.zeros((docs, b), bool), "open": jnp.ones((docs, 1), bool),
            "all_ended": jnp.array(False), "cur_len": jnp.array(1, jnp.int32)}


def beam_search(model, input_ids, attention_mask, s: GenerationSettings):
    """The best hypothesis per document [docs, max_length] (see the module's docstring)."""
    docs, beams = input_ids.shape[0], s.num_beams
    states = model.encode(input_ids, attention_mask)
    cross = model.cross_keys_values(states)  # [docs, heads, src, hd] per layer: once per document
    cache = model.empty_cache(docs, beams, s.max_length, states.dtype)
    penalties = _penalties(s)

    def body(carry):
        state, cache = carry
        cur = state["cur_len"]
        tokens = jax.lax.dynamic_index_in_dim(state["running"], cur - 1, axis=2, keepdims=False)
        logits, cache = model.decode_step(tokens, cur - 1, cache, cross, attention_mask)
        flat = jax.nn.log_softmax(logits.reshape(docs * beams, -1))
        flat = _process(flat, state["running"].reshape(docs * beams, -1), cur, s)
        state, origin = _select(state, flat.reshape(docs, beams, -1), s, penalties)
        cache = jax.tree.map(lambda c: _gather(c, origin), cache)  # each surviving beam's own past
        if s.semantics == "torch":
            state["open"] = state["open"] & _still_open(state, s, penalties)
        return state, cache

    state, _ = jax.lax.while_loop(lambda c: _keep_going(c[0], s, penalties), body, (_initial_state(docs, s), cache))
    if s.semantics == "flax":  # Flax returns the running beams where nothing finished
        any_done = jnp.any(state["finished"], axis=1)
        return jnp.where(any_done[:, None], state["sequences"][:, 0], state["running"][:, 0])
    return state["sequences"][:, 0]


def make_generate(graphdef, settings: GenerationSettings, on_trace=None):
    """(state, input_ids, attention_mask) -> token ids [docs, max_length]: `beam_search` of the model nnx.merge
    makes from (graphdef, state). `on_trace` runs while tracing (the summarizer counts compilations)."""

    def generate(state, input_ids, attention_mask):
        if on_trace is not None:
            on_trace()
        return beam_search(nnx.merge(graphdef, state), input_ids, attention_mask, settings)

    return generate
