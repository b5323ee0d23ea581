"""The command bodies that need no index: retrieve.py's flag checks (one line each, before any config is read), the
hits kept and shown, the verify command's exit status and lines, and the service's bind of a taken port."""

import argparse
import io
import socket

import pytest

from cfir_jax.commands import flags, verify
from cfir_jax.core.errors import CfirError
from cfir_jax.serve import middleware


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    flags.retrieve_flags(parser)
    return parser.parse_args(argv)


def test_a_retrieve_command_line_that_holds_together_passes_and_parses_its_ks():
    args = _args("--evaluate", "test", "--compare-k", "1000,5000", "--measures", "both")
    flags.check_retrieve(args)
    assert args.compare_k == (1000, 5000)


@pytest.mark.parametrize("argv, refusal", [
    ((), "give exactly one of --query, --queries, --evaluate"),
    (("--query", "d.txt", "--format", "xml"), "unknown format 'xml'"),
    (("--query", "d.txt", "--plot", "r.png"), "--plot draws the recall curves of --evaluate SPLIT"),
    (("--evaluate", "test", "--plot", "r.jpg"), "r.jpg"),
    (("--query", "d.txt", "--top-k", "0"), "--top-k must be at least 1, got 0"),
    (("--query", "d.txt", "--measures", "ndcg"), "--measures 'ndcg': use one of trec_eval"),
    (("--query", "d.txt", "--compare-k", "10"), "--compare-k evaluates full CFIR at several K"),
    (("--evaluate", "test", "--compare", "--compare-k", "10"), "separate runs"),
    (("--evaluate", "test", "--compare-k", "ten"), "ten"),
    (("--evaluate", "test", "--lang", "fr"), "--lang states the language of --query or --queries documents"),
    (("--query-image-id", "img1", "--lang", "fr"), "--lang states the language of --query or --queries"),
])
def test_each_inconsistent_retrieve_command_line_is_one_line(argv, refusal):
    with pytest.raises(CfirError, match=refusal.replace("(", r"\(")):
        flags.check_retrieve(_args(*argv))


def test_lang_goes_with_query_documents():
    for argv in (("--query", "d.txt", "--lang", "fr"), ("--queries", "q.jsonl", "--lang", "id")):
        args = _args(*argv)
        flags.check_retrieve(args)
        assert args.lang == argv[-1]
    assert _args("--query", "d.txt").lang is None  # found where the collection is not all English


def test_hits_kept_and_shown_follow_top_k():
    class Config:
        class retrieval:  # noqa: N801 - stands in for the config section
            top_k = 1000

    assert flags.hit_budget(Config, None) == (1000, flags.SHOWN)
    assert flags.hit_budget(Config, 5) == (5, 5) and Config.retrieval.top_k == 1000
    assert flags.hit_budget(Config, 2000) == (2000, 2000) and Config.retrieval.top_k == 2000


def test_verify_says_what_it_found_and_exits_2_on_damage(tmp_path, capsys):
    out = io.StringIO()
    assert verify.run(tmp_path / "nope") == 2
    assert "no workdir here" in capsys.readouterr().err
    assert verify.run(tmp_path, out=out) == 0 and out.getvalue() == "verify: 0 store(s) intact\n"
    (tmp_path / "entities").mkdir()
    (tmp_path / "entities" / "manifest.json").write_text("{}")
    assert verify.run(tmp_path, out=out) == 2
    assert "damaged: " in capsys.readouterr().err and "1 problem(s)" in out.getvalue()


def test_a_taken_port_is_one_line_before_anything_loads():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.raises(CfirError, match=rf"cannot listen on 127.0.0.1:{taken.getsockname()[1]}: .*pick another"):
            middleware.bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
    free = middleware.bind("127.0.0.1", 0)
    assert free.getsockname()[1] > 0
    free.close()


def test_the_method_flag_names_every_registered_method_and_the_engine_flag_every_engine():
    """The flags stay light (no JAX: they cannot import the methods), so their help names the methods in words; the
    registry is what they must agree with. The engines' choices are the registry's own."""
    from cfir_jax.core.config_check import SERVE_ENGINES
    from cfir_jax.retrieve.methods import METHODS

    parser = argparse.ArgumentParser()
    flags.retrieve_flags(parser)
    actions = {a.dest: a for a in parser._actions}
    assert actions["method"].help.split(" | ") == list(METHODS)
    assert actions["engine"].choices == sorted(SERVE_ENGINES) == ["local", "ray"]
