"""transformers 4.x's XLMRobertaTokenizer as the tokenizer's oracle, run in its own process.

unilm's BEiT-3 tokenizes with `XLMRobertaTokenizer(beit3.spm)`, the sentencepiece-backed class of transformers 4.x.
5.x replaced it with a conversion to a `tokenizers` Unigram model whose ids differ on some text, so the oracle is the
4.x class from the side copy the test set keeps (scripts/setup.sh: .venv/oracle-transformers4), put first on this
subprocess's PYTHONPATH: `python xlmr_reference.py` reads {"spm": path, "texts": [...]} as JSON on stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path(os.environ.get("CFIR_TRANSFORMERS4", ROOT / ".venv" / "oracle-transformers4"))


def xlmr_reference(spm: Path, texts: list[str]) -> dict:
    """{"ids": each text's piece ids (no <s>/</s>), "vocab": len(tokenizer), "mask_id": its mask id}."""
    paths = [str(ORACLE)] if ORACLE.is_dir() else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__], input=json.dumps({"spm": str(spm), "texts": texts}), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"XLM-R reference failed (transformers 4.x at {ORACLE}?):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


def main() -> None:
    import transformers
    from transformers import XLMRobertaTokenizer

    version = transformers.__version__
    assert version.startswith("4."), f"the oracle needs transformers 4.x, not {version}"
    request = json.load(sys.stdin)
    ref = XLMRobertaTokenizer(request["spm"])
    ids = [ref.convert_tokens_to_ids(ref.tokenize(text)) for text in request["texts"]]
    json.dump({"ids": ids, "vocab": len(ref), "mask_id": ref.mask_token_id}, sys.stdout)


if __name__ == "__main__":
    main()
