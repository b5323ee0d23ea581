"""A config variant string, the text after the colon of `--config FILE:VARIANT` (big_vision's convention): typed
values, in any order (`configs/demo.py:full,tiny` is `configs/demo.py:tiny,full`)."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """A config variant string -> ConfigDict of typed values (big_vision's convention).

    'runlocal,res=384' with defaults (res=224, runlocal=False) -> {res: 384, runlocal: True}: `key=value` converts
    to the default's type, a bare `key` sets a boolean default to True, and a bare number sets `res` (so
    `configs/base.py:384` works). An unknown key is an error, never a silent default.
    """
    out = ml_collections.ConfigDict(defaults)
    for token in (t.strip() for t in (arg or "").split(",")):
        if not token:
            continue
        key, sep, value = token.partition("=")
        if not sep and key.isdigit() and "res" in defaults:
            key, value, sep = "res", key, "="
        if key not in defaults:
            raise ValueError(f"unknown config variant {key!r}: use {', '.join(sorted(defaults))}")
        default = defaults[key]
        if not sep:
            if not isinstance(default, bool):
                raise ValueError(f"config variant {key!r} needs a value: {key}=...")
            out[key] = True
        elif isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config variant {key}={value!r}: expected true or false")
            out[key] = value.lower() in ("true", "1")
        else:
            try:
                out[key] = type(default)(value)
            except ValueError:
                raise ValueError(f"config variant {key}={value!r}: expected {type(default).__name__}") from None
    return out
