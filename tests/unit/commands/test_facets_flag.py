"""retrieve.py --facets (issue 61 item 4): a comma-separated list of fields, each named once, with --query, --queries
or --query-image(-id); with any other mode, or holding an empty name, one line before any config is read."""

import argparse

import pytest

from cfir_jax.commands import flags
from cfir_jax.core.errors import CfirError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    flags.retrieve_flags(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("mode", [("--query", "d.txt"), ("--queries", "q.jsonl"), ("--query-image-id", "img1")])
def test_facets_parse_to_their_fields_each_once(mode):
    args = _args(*mode, "--facets", "source, tags,source,date")
    flags.check_retrieve(args)
    assert args.facets == ["source", "tags", "date"]
    plain = _args(*mode)
    flags.check_retrieve(plain)
    assert plain.facets is None


@pytest.mark.parametrize("argv, refusal", [
    (("--evaluate", "test", "--facets", "source"), "--facets counts what a query ranked: use it with --query"),
    (("--query", "d.txt", "--facets", "source,,tags"), "facets: 'source,,tags' holds an empty or invalid field"),
])
def test_facets_out_of_place_or_malformed_are_one_line(argv, refusal):
    with pytest.raises(CfirError, match=f"^{refusal}"):
        flags.check_retrieve(_args(*argv))
