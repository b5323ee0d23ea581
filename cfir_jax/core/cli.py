"""Shared command-line plumbing: `--config FILE[:variant]` plus `--config.a.b=value` overrides (config_flags), and
`cli_main`, the one place a command turns an error into a one-line message and an exit code: 2 for the user's input
and a full disk, 143 for SIGTERM (cfir_jax.core.faults), 130 for Ctrl-C."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ml_collections
from absl import flags
from ml_collections import config_flags

from cfir_jax.core import compile_cache, faults, progress
from cfir_jax.core.config_check import check
from cfir_jax.core.config_upgrade import MOVED, moved_line, upgrade
from cfir_jax.core.errors import CfirError, os_error_line, quiet_abandoned_async_work

F = TypeVar("F", bound=Callable)


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """'configs/base.py:384' -> get_config('384') of that file; every problem is one CfirError line."""
    path, _, arg = spec.partition(":")
    if not Path(path).is_file():
        raise CfirError(f"{path}: config file not found")
    # Config files import their siblings (`from configs.base import experiment`): the folder above configs/ is
    # importable wherever the command runs from.
    root = str(Path(path).resolve().parent.parent)
    if root not in sys.path:
        sys.path.append(root)
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
    """The config an index was built with (recorded in W/index.json by index.py), with the fields added since it was
    recorded filled in (`cfir_jax.core.config_upgrade.upgrade`: the one place that happens)."""
    path = Path(workdir) / "index.json"
    if not Path(workdir).is_dir():
        raise CfirError(f"{workdir}: no index here (missing directory); build it with index.py")
    if not path.is_file():
        raise CfirError(f"{workdir}: incomplete index (no index.json); run index.py to finish it")
    try:
        config = ml_collections.ConfigDict(json.loads(path.read_text())["config"])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError):
        raise CfirError(f"{path}: unreadable; run index.py again") from None
    return upgrade(config)


def load(config_spec: str, workdir: str | os.PathLike | None, overrides: Sequence[str] = ()
         ) -> ml_collections.ConfigDict:
    """The one way a command (and a service's reload) reads its config: `config_spec` (a config file and variant)
    or, when empty, the config `workdir` was built with, then the `--config.*` overrides; each section is checked
    once, here (`cfir_jax.core.config_check.check`)."""
    config = load_config_file(config_spec) if config_spec else workdir_config(workdir)
    return check(apply_overrides(config, overrides))


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """`--config.a.b=value` strings applied by ml_collections.config_flags (its parsing and type checks), and those
    of a list or tuple field by `sequence_value` (config_flags refuses a list: what a workdir's JSON config holds); an
    unknown field or an ill-typed value is one CfirError line naming the override."""
    if not overrides:
        return config
    sequences: dict[str, list[str]] = {}
    rest = []
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise CfirError(f"unrecognised argument {item!r}: overrides look like --config.train.lr=3e-4")
        key, _, text = item[len("--config."):].partition("=")
        _field(config, key, "--config.")
        parent, _, leaf = key.rpartition(".")
        node = _field(config, parent, "--config.") if parent else config
        if node.get_type(leaf) in (list, tuple):  # declared so (a field of `object` type takes any literal)
            sequences.setdefault(key, []).append(text)  # repeated flags add items, as config_flags' tuples do
        else:
            rest.append(item)
    if rest:
        argv = ["cfir", *rest]
        flag_values = flags.FlagValues()
        config_flags.DEFINE_config_dict("config", config, flag_values=flag_values, lock_config=False, sys_argv=argv)
        try:
            flag_values(argv)
        except flags.Error as e:
            raise CfirError(" ".join(str(e).split())) from None
        config = flag_values.config
    for key, texts in sequences.items():
        parent, _, leaf = key.rpartition(".")
        node = _field(config, parent, "--config.") if parent else config
        node[leaf] = sequence_value(key, texts, node[leaf])  # the field keeps its type (a list stays a list)
    return config


def sequence_value(key: str, texts: Sequence[str], current: Sequence) -> tuple:
    """The items of `--config.KEY=TEXT` for a list or tuple field, in one line: a Python literal (`'(4096, 16384)'`,
    `"['cfir', 'bm25']"`) or bare items separated by commas (`cfir,bm25`, `[cfir, bm25]`, `4096,16384`); each item
    converted to the type of the field's items (an int field's items must be ints). One CfirError line otherwise."""
    items = []
    for text in texts:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = [part.strip().strip("'\"") for part in text.strip().strip("[]()").split(",") if part.strip()]
        items += list(value) if isinstance(value, (list, tuple)) else [value]
    kinds = {type(item) for item in current}
    if len(kinds) != 1:
        return tuple(items)
    kind = kinds.pop()
    if kind in (list, tuple) and not all(isinstance(item, (list, tuple)) for item in items):
        raise CfirError(f"--config.{key}={','.join(texts)}: the field holds a list of lists (rules): give it as a "
                        "Python literal, e.g. '[[\".*\", \"frozen\"]]'")
    try:
        return tuple(item if isinstance(item, kind) else kind(item) for item in items)
    except (TypeError, ValueError):
        raise CfirError(f"--config.{key}={','.join(texts)}: its items are {kind.__name__}s, e.g. --config.{key}="
                        f"{','.join(str(item) for item in current)}") from None


def apply_values(config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """The library's overrides (`cfir_jax.open(W, retrieval__top_k=100)`): {"retrieval.top_k": 100} (or
    "retrieval__top_k") set on the config as Python values, with the ConfigDict's type checks; an unknown field or
    an ill-typed value is one CfirError line naming the field."""
    for name, value in values.items():
        key = name.replace("__", ".")
        parent, _, leaf = key.rpartition(".")
        _field(config, key, "")
        node = _field(config, parent, "") if parent else config
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:
            raise CfirError(f"{key}={value!r}: {' '.join(str(e).split())}") from None
    return config


def _field(config: ml_collections.ConfigDict, key: str, prefix: str):
    """The value of the config field `key` ("a.b.c"), or one CfirError line when there is no such field (or when
    it moved: the line names its new name)."""
    if key in MOVED:
        raise CfirError(moved_line(key, prefix))
    node = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise CfirError(f"{prefix}{key}: unknown config field (see the config file for the fields)")
        node = node[part]
    return node


def overrides_help(example: str = "--config.train.lr=3e-4") -> str:
    """The --help epilog of every command: how to override config fields."""
    return (f"Any config field can be set on the command line as --config.SECTION.FIELD=VALUE, e.g. {example} "
            "--config.index.entity_index.k=1000 --config.tokenizer=beit3.spm, a list as "
            "--config.serve.methods=cfir,bm25 (the fields are those of the config file; an unknown field is an "
            "error).")


def parse(description: str, add_arguments=None, argv: list[str] | None = None, *, workdir_flag: str = "--workdir",
          config_from_workdir: bool = False, check_args=None, example: str = "--config.train.lr=3e-4"):
    """Parses `--config`, the workdir flag, the tool's own flags and config overrides; returns (args, config), the
    config locked. config_from_workdir: --config is optional and defaults to the config the workdir was built with
    (upgraded, `workdir_config`); check_args(args): the tool's own flag checks, run before any config is read."""
    epilog = "The config is the index's own (W/index.json) unless --config is given. " if config_from_workdir else ""
    parser = argparse.ArgumentParser(description=description, epilog=epilog + overrides_help(example))
    if config_from_workdir:
        parser.add_argument("--config", default="", help="config file; default: the config the index was built with")
        parser.add_argument(workdir_flag, help="workdir built by index.py (and train.py)")
    else:
        parser.add_argument("--config", required=True,
                            help="config file, e.g. configs/base.py or configs/demo.py:tiny")
        parser.add_argument(workdir_flag, help="directory holding the stores (see cfir_jax/stores/layout.py)")
    add_compile_only_flags(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more: -v this project's progress logs, -vv the libraries' too (orbax, absl)")
    if add_arguments:
        add_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    workdir = getattr(args, workdir_flag.lstrip("-").replace("-", "_"))
    if args.compile_only and not args.config:
        parser.error("--compile-only needs --config (e.g. configs/base.py or configs/large.py)")
    if not args.compile_only and not workdir:
        parser.error(f"the following arguments are required: {workdir_flag}")
    if check_args:
        check_args(args)
    config = load(args.config, workdir, rest)
    config.lock()
    progress.set_log_levels(args.verbose)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not args.compile_only:  # before the first compile; --compile-only reports its compiles, so it makes them all
        compile_cache.enable()
    return args, config


def add_compile_only_flags(parser: argparse.ArgumentParser) -> None:
    """MaxText's convention: compile the command's accelerator programs for a TPU topology, build and read nothing."""
    parser.add_argument("--compile-only", action="store_true", help="compile this command's accelerator programs "
                        "for --topology (no TPU needed, no workdir or data read) and print each device's memory")
    parser.add_argument("--topology", default="", help="with --compile-only: a TPU topology, e.g. v5e:2x4, v5p:4x4x4 "
                        "(or v4-8, v5e-16, v5p-64, v6e-8)")


def maybe_initialize_distributed() -> None:
    """jax.distributed.initialize() when the environment describes several processes (TPU pods, SLURM, or the
    JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID variables)."""
    # why: JAX loads only when a command starts its computation, not for --help or a flag error
    import jax

    env = os.environ
    several = bool(env.get("JAX_COORDINATOR_ADDRESS") or env.get("TPU_WORKER_HOSTNAMES")) or \
        int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if several:
        # CPU processes need a cross-process collectives library for what spans processes (orbax's restore syncs
        # through one); the setting touches the CPU backend only, accelerators bring their own.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
                                   int(env["JAX_PROCESS_ID"]))
    elif env.get("TPU_WORKER_HOSTNAMES") or int(env.get("SLURM_NTASKS", "1")) > 1 or \
            int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()


def cli_main(fn: F) -> F:
    """Wraps a command-line entry point: a CfirError (or a missing file) becomes `error: ...` on stderr, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        quiet_abandoned_async_work()
        try:
            return fn(*args, **kwargs)
        except CfirError as e:
            _exit(f"error: {e}", 2)
        except KeyboardInterrupt:
            _exit("interrupted", 130)
        except BaseException as e:
            described = faults.describe(e)  # a full disk, SIGTERM
            if described is not None:
                message, status = described
                _exit(message if status == faults.EXIT_SIGTERM else f"error: {message}", status)
            if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError)):
                _exit(f"error: {os_error_line(e)}", 2)
            raise

    return wrapper  # type: ignore[return-value]


def _exit(line: str, status: int) -> None:
    print(line, file=sys.stderr)
    sys.exit(status)
