"""The BEiT-3 tokenizer: sentencepiece `beit3.spm` with the XLM-R (fairseq) id mapping, as XLMRobertaTokenizer maps.

Ids: <s>=0, <pad>=1, </s>=2, <unk>=3, every other piece = its sentencepiece id + 1, <mask> = pieces + 1.
A sequence is [0] + ids[:max_len - 2] + [2], right-padded with 1; the padding mask is True on the padded tail only,
derived from each sequence's length (a literal "<pad>" written in the text is id 1 too, and XLM-R attends to it).
Ids equal `transformers.XLMRobertaTokenizer(vocab_file=beit3.spm)` (4.x) token for token, including its handling
of special-token strings written in the text ("<s>", "<mask>", ...), but run through sentencepiece's batched C++
encoder directly, without transformers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError, first_line

BOS, PAD, EOS, UNK = 0, 1, 2, 3
_FAIRSEQ_OFFSET = 1


class Beit3Tokenizer:
    """`tok(texts, max_len) -> (ids [B, max_len] int32, padding_mask [B, max_len] bool)`."""

    def __init__(self, spm_path: str | os.PathLike):
        # why: sentencepiece loads only when a tokenizer is opened or trained
        import sentencepiece as spm

        path = Path(spm_path)
        if not path.is_file():
            raise CfirError(f"{path}: sentencepiece model not found (BEiT-3 uses beit3.spm)")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise CfirError(f"{path}: not a sentencepiece model ({first_line(e)})") from None
        self.path = path
        self.mask_id = self.sp.GetPieceSize() + _FAIRSEQ_OFFSET
        self.vocab_size = self.sp.GetPieceSize() + 2  # pieces + <mask> + the <s>/<pad> shift
        self._special = {"<s>": BOS, "<pad>": PAD, "</s>": EOS, "<unk>": UNK, "<mask>": self.mask_id}
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in self._special) + ")")

    def _map(self, pieces: Sequence[int]) -> list[int]:
        # spm id 0 is <unk>; XLM-R maps it to 3 rather than 0 + offset.
        return [p + _FAIRSEQ_OFFSET if p else UNK for p in pieces]

    def _encode_with_specials(self, text: str) -> list[int]:
        """Special-token strings in the text become their ids, as the transformers tokenizer splits them out."""
        ids: list[int] = []
        parts = self._special_re.split(text)
        for i, part in enumerate(parts):
            if i % 2 == 1:
                ids.append(self._special[part])
                continue
            if i + 1 < len(parts) and parts[i + 1] == "<mask>":
                part = part.rstrip()  # <mask> is an lstrip token in XLM-R: it eats the spaces before it
            if part:
                ids.extend(self._map(self.sp.encode(part)))
        return ids

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Piece ids of each text, without BOS/EOS or truncation."""
        texts = list(texts)
        plain = [i for i, t in enumerate(texts) if "<" not in t]
        out: list[list[int]] = [[] for _ in texts]
        for i, pieces in zip(plain, self.sp.encode([texts[i] for i in plain])):
            out[i] = self._map(pieces)
        for i, t in enumerate(texts):
            if "<" in t:
                out[i] = self._encode_with_specials(t)
        return out

    def __call__(self, texts: str | Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
        if max_len < 2:
            raise CfirError(f"max_len must be >= 2 (BOS and EOS), got {max_len}")
        if isinstance(texts, str):
            texts = [texts]
        ids = np.full((len(texts), max_len), PAD, np.int32)
        lengths = np.empty((len(texts), 1), np.int32)
        for row, pieces in enumerate(self.encode(texts)):
            seq = [BOS] + pieces[: max_len - 2] + [EOS]
            ids[row, : len(seq)] = seq
            lengths[row] = len(seq)
        # From lengths, not `ids == PAD`: a "<pad>" inside the text is a real token (id 1) that must be attended to.
        return ids, np.arange(max_len)[None, :] >= lengths


def resolve_tokenizer(config, corpus) -> Beit3Tokenizer:
    """The config's tokenizer (beit3.spm), else the one a corpus (`data.corpus.Corpus`) ships (synthetic worlds)."""
    path = config.tokenizer or corpus.tokenizer_path
    if not path:
        raise CfirError("no tokenizer: set --config.tokenizer=/path/to/beit3.spm (BEiT-3's sentencepiece model)")
    return Beit3Tokenizer(path)
