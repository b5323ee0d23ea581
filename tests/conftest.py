import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# The real BEiT-3 tokenizer (never committed): $CFIR_BEIT3_SPM, else the shared copy beside the worktrees.
SPM_PATH = Path(os.environ.get("CFIR_BEIT3_SPM", ROOT.parent / "shared" / "data" / "beit3.spm"))
