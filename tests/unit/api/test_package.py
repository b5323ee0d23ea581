"""The package as a library: `import cfir_jax` loads no JAX, its names load their modules on first use (the client
none of JAX either), `cfir_jax.train` is the library's `train` (a function, loaded on first use), the type marker
ships, and the console scripts pip installs are the functions the three scripts run."""

import importlib
import subprocess
import sys
import tomllib

import pytest
from repo import ROOT

import cfir_jax
from cfir_jax.api import operations


def _modules_after(code: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"], cwd=ROOT,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split())


def test_import_cfir_jax_loads_no_jax():
    loaded = _modules_after("import cfir_jax")
    assert not {"jax", "numpy", "flax", "spacy", "cfir_jax.api.index"} & loaded


def test_the_client_and_the_records_load_no_jax():
    loaded = _modules_after("import cfir_jax\ncfir_jax.Client('http://127.0.0.1:1'); cfir_jax.Result; cfir_jax.Hit")
    assert "cfir_jax.api.client" in loaded
    assert not {"jax", "numpy", "flax", "spacy"} & loaded


def test_every_public_name_resolves_to_its_module():
    assert set(cfir_jax.__all__) == {"__version__", *cfir_jax._API}
    for name, (module, attribute) in cfir_jax._API.items():
        assert getattr(cfir_jax, name) is getattr(importlib.import_module(module), attribute), name
    assert cfir_jax.open.__module__ == "cfir_jax.api.index"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        cfir_jax.nothing  # noqa: B018


def test_train_is_the_library_function_and_the_training_package_does_not_replace_it(monkeypatch):
    """`cfir_jax.train` is a plain function; importing the training package (`cfir_jax.training`) leaves it so."""
    import cfir_jax.training.loop  # noqa: F401

    assert cfir_jax.train is operations.train
    called = []
    monkeypatch.setattr(operations, "train", lambda config, w, **overrides: called.append((config, w, overrides)))
    monkeypatch.delitem(vars(cfir_jax), "train")  # the lazy lookup again, onto the stand-in
    cfir_jax.train("configs/demo.py", "W", train__steps=2)
    assert called == [("configs/demo.py", "W", {"train__steps": 2})]


def test_the_type_marker_ships_with_the_package():
    assert (ROOT / "cfir_jax" / "py.typed").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["cfir_jax"]


@pytest.mark.parametrize("command", ["index", "train", "retrieve"])
def test_each_console_script_is_the_function_its_script_runs(command):
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][f"cfir-{command}"]
    module, _, function = target.partition(":")
    script = importlib.import_module(command)  # the repository root's index.py, train.py, retrieve.py
    assert script.__file__ == str(ROOT / f"{command}.py")
    assert getattr(importlib.import_module(module), function) is script.main
