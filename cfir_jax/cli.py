"""Shared command-line plumbing: `--config FILE[:variant]` plus `--config.a.b=value` overrides."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
from pathlib import Path

import ml_collections

from cfir_jax import progress
from cfir_jax.errors import CfirError


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """'configs/base.py:384' -> get_config('384') of that file."""
    path, _, arg = spec.partition(":")
    if not Path(path).is_file():
        raise CfirError(f"{path}: config file not found")
    module_spec = importlib.util.spec_from_file_location(f"cfir_config_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise CfirError(f"{path}: not a Python config file ({e.msg}, line {e.lineno})") from None
    if not hasattr(module, "get_config"):
        raise CfirError(f"{path}: defines no get_config(arg)")
    try:
        return module.get_config(arg or None)
    except ValueError as e:
        raise CfirError(f"{spec}: {e}") from None


def workdir_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
    """The config an index was built with (recorded in W/index.json by index.py)."""
    import json

    path = Path(workdir) / "index.json"
    if not Path(workdir).is_dir():
        raise CfirError(f"{workdir}: no index here (missing directory); build it with index.py")
    if not path.is_file():
        raise CfirError(f"{workdir}: incomplete index (no index.json); run index.py to finish it")
    try:
        return ml_collections.ConfigDict(json.loads(path.read_text())["config"])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError):
        raise CfirError(f"{path}: unreadable; run index.py again") from None


def _parse_value(text: str, current):
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"expected true/false, got {text!r}")
    elif isinstance(current, float) and isinstance(value, int):
        return float(value)
    elif isinstance(current, int) and not isinstance(current, bool) and not isinstance(value, int):
        raise ValueError(f"expected an integer, got {text!r}")
    elif isinstance(current, float) and not isinstance(value, float):
        raise ValueError(f"expected a number, got {text!r}")
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> ml_collections.ConfigDict:
    """Applies `--config.a.b=value` strings; unknown fields and ill-typed values are one-line errors."""
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise CfirError(f"unrecognised argument {item!r}: overrides look like --config.train.lr=3e-4")
        key, _, text = item[len("--config."):].partition("=")
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            if p not in node or not isinstance(node[p], ml_collections.ConfigDict):
                raise CfirError(f"--config.{key}: the config has no section {p!r}")
            node = node[p]
        if leaf not in node:
            raise CfirError(f"--config.{key}: unknown config field (see the config file for the fields)")
        try:
            node[leaf] = _parse_value(text, node[leaf])
        except (ValueError, TypeError) as e:
            raise CfirError(f"--config.{key}: {e}") from None
    return config


def overrides_help(example: str = "--config.train.lr=3e-4") -> str:
    """The --help epilog of every command: how to override config fields."""
    return (f"Any config field can be set on the command line as --config.SECTION.FIELD=VALUE, e.g. {example} "
            "--config.index.entity_index.k=1000 --config.tokenizer=beit3.spm (the fields are those of the config "
            "file; an unknown field is an error).")


def parse(description: str, add_arguments=None, argv: list[str] | None = None):
    """Parses `--config`, `--workdir`, the tool's own flags and config overrides; returns (args, config)."""
    parser = argparse.ArgumentParser(description=description, epilog=overrides_help())
    parser.add_argument("--config", required=True, help="config file, e.g. configs/base.py or configs/demo.py:tiny")
    parser.add_argument("--workdir", required=True, help="directory holding the stores (see cfir_jax/layout.py)")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more: -v this project's progress logs, -vv the libraries' too (orbax, absl)")
    if add_arguments:
        add_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    config = apply_overrides(load_config_file(args.config), rest)
    config.lock()
    progress.set_log_levels(args.verbose)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return args, config


def maybe_initialize_distributed() -> None:
    """jax.distributed.initialize() when the environment describes several processes (TPU pods, SLURM, or the
    JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID variables)."""
    import jax

    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
                                   int(env["JAX_PROCESS_ID"]))
    elif env.get("TPU_WORKER_HOSTNAMES") or int(env.get("SLURM_NTASKS", "1")) > 1 or \
            int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
