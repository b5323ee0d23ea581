"""The command bodies (cfir_jax/commands/) run in-process, as a library caller would, and say what the scripts say."""

import re

from repo import run_script
from workdirs import full_trained

from cfir_jax.commands import evaluate
from cfir_jax.core.cli import workdir_config


def _without_timing(text: str) -> list[list[str]]:
    """Each line's cells, the evaluation table's ms/query (a measured time, column 7) left out."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    return [r[:6] + r[7:] if len(r) >= 8 else r for r in rows]


def test_the_evaluate_body_in_process_prints_the_table_of_retrieve_py(workdir, capsys):
    """`commands.evaluate.run(config, workdir, Topics(split))` is `retrieve.py --index W --evaluate split`, without
    the flags: the same evaluation table, to the digit (but for the measured ms/query)."""
    rows = evaluate.run(workdir_config(workdir), str(workdir), evaluate.Topics("test"))
    table = capsys.readouterr().out
    assert len(rows) == 1 and table.startswith("test split, ")
    script = run_script("retrieve.py", "--index", str(workdir), "--evaluate", "test")
    assert _without_timing(table) == _without_timing(script.stdout)


def test_a_workdir_where_full_training_ran_passes_index_py_verify(tmp_path):
    """W/train_full (checkpoints, no manifest) is a training run, not an incomplete store: `index.py --verify` checks
    the stores beside it and exits 0."""
    w = full_trained(tmp_path / "W")
    proc = run_script("index.py", "--verify", "--workdir", str(w), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: 2 store(s) intact (corpus, model_full)" in proc.stdout
