"""The BEiT-3 tokenizer gives the ids of transformers' XLMRobertaTokenizer (4.x, the class unilm's BEiT-3 uses) on the
real beit3.spm."""

import random

import numpy as np
import pytest
from repo import NEEDS_BEIT3_SPM, SPM_PATH
from xlmr_reference import xlmr_reference

from cfir_jax.core.errors import CfirError
from cfir_jax.model.tokenizer import Beit3Tokenizer

WORDS = ["Eiffel", "Tower", "photo", "of", "the", "Zürich", "naïve", "東京", "Москва", "مرحبا", "🙂", "e.g.", "U.S.",
         "1,024", "3.14", "don't", "—", "«quote»", "C++", "x86_64", "<s>", "</s>", "<mask>", "<pad>", "<unk>", "<",
         ">", "&amp;", "http://example.org/a_b", "ﬁ", "Å", "ǅ", "\u200b", "a\u0301"]
SPACES = [" ", "  ", "\t", "\n", " \n ", "\u3000", "\u00a0", ""]


def _reference(spm):
    """The oracle's piece ids for a list of texts (one subprocess per call: ask for a whole list at once)."""
    return lambda texts: xlmr_reference(spm, list(texts))["ids"]


def _varied_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["", " ", "   ", "\n\t", "A photo of the Eiffel Tower", "a" * 5000, "word " * 2000]
    while len(out) < n:
        k = rng.randint(1, 40)
        out.append("".join(rng.choice(WORDS) + rng.choice(SPACES) for _ in range(k)))
        out.append("".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 60))))
    return out[:n]


@pytest.fixture(scope="module")
def tokenizers():
    """Ours and transformers' on the real beit3.spm (the tests taking this fixture are marked NEEDS_BEIT3_SPM)."""
    if not SPM_PATH.is_file():
        pytest.skip(f"needs BEiT-3's beit3.spm at {SPM_PATH} (set CFIR_BEIT3_SPM)")
    return Beit3Tokenizer(SPM_PATH), _reference(SPM_PATH)


@NEEDS_BEIT3_SPM
def test_reference_example(tokenizers):
    ours, _ = tokenizers
    assert ours.encode(["A photo of the Eiffel Tower"]) == [[94, 1127, 9, 4, 41823, 6184]]


@NEEDS_BEIT3_SPM
def test_ids_equal_transformers_on_varied_strings(tokenizers):
    ours, ref = tokenizers
    texts = _varied_strings(600)
    for text, ids, want in zip(texts, ours.encode(texts), ref(texts), strict=True):
        assert ids == want, repr(text)


def test_ids_equal_transformers_on_the_synthetic_model(synthetic_spm):
    """The id mapping, checked without beit3.spm: the synthetic world's model has the same <unk>/<s>/</s> ids."""
    ours, ref = Beit3Tokenizer(synthetic_spm), _reference(synthetic_spm)
    texts = _varied_strings(200, seed=2) + ["Mary Walker visited Lake Ashford and the Stoneford Institute."]
    for text, ids, want in zip(texts, ours.encode(texts), ref(texts), strict=True):
        assert ids == want, repr(text)


@NEEDS_BEIT3_SPM
def test_batch_layout_matches_reference_recipe(tokenizers):
    """[0] + ids[:max_len-2] + [2], padded with 1; mask True on the padded tail (unilm's BEiT-3 dataset)."""
    ours, ref = tokenizers
    texts = _varied_strings(50, seed=1)
    ids, mask = ours(texts, 16)
    assert ids.shape == mask.shape == (50, 16) and ids.dtype == np.int32
    for row, pieces in enumerate(ref(texts)):
        pieces = pieces[:14]
        want = [0] + pieces + [2]
        length = len(want)
        want += [1] * (16 - length)
        assert ids[row].tolist() == want
        assert mask[row].tolist() == [i >= length for i in range(16)]


@NEEDS_BEIT3_SPM
def test_vocab_and_special_ids(tokenizers):
    ours, _ = tokenizers
    facts = xlmr_reference(SPM_PATH, [])
    assert ours.vocab_size == facts["vocab"] == 64002
    assert ours.mask_id == facts["mask_id"]


def test_missing_or_bad_model_is_one_line_error(tmp_path):
    with pytest.raises(CfirError, match="not found"):
        Beit3Tokenizer(tmp_path / "nope.spm")
    bad = tmp_path / "bad.spm"
    bad.write_bytes(b"\x00\x01garbage")
    with pytest.raises(CfirError, match="not a sentencepiece model"):
        Beit3Tokenizer(bad)


@pytest.fixture(scope="module")
def synthetic_tokenizers(tmp_path_factory):
    """The synthetic world's kind of sentencepiece model (beit3.spm's id conventions), ours and transformers'."""
    from cfir_jax.data.synthetic import train_tokenizer

    path = tmp_path_factory.mktemp("spm") / "tokenizer.spm"
    texts = [f"Document {i} mentions the Harbour Bridge of Quokka Island and a padded sentence number {i * 7}."
             for i in range(200)]
    train_tokenizer(texts, path, vocab_size=120)
    return Beit3Tokenizer(path), _reference(path)


@pytest.mark.parametrize("which", ["beit3", "synthetic"])
def test_literal_pad_in_text_is_attended_to(request, which):
    """"<pad>" written in a document is token 1 (as XLM-R splits it out) but a real token: mask 0 there, 1 only on
    the padded tail."""
    ours, ref = request.getfixturevalue("tokenizers" if which == "beit3" else "synthetic_tokenizers")
    texts = ["the bridge <pad> of the island", "<pad>", "<pad><pad> island <pad>"]
    ids, mask = ours(texts, 48)
    for row, pieces in enumerate(ref(texts)):
        want = [0] + pieces + [2]
        assert 1 in want[1:-1]  # the literal <pad> became id 1
        assert ids[row, : len(want)].tolist() == want
        assert not mask[row, : len(want)].any() and mask[row, len(want) :].all()
