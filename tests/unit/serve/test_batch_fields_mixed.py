"""Where issue 61's field types meet issue 58's requests that fail alone: a micro-batch mixing filters on a list, a
boolean (a Python True triple, a "false" line) and dates at a year's, a month's and a minute's precision with refused
ones (an order on a list, a boolean that is neither, an unknown field, a filter past each of its limits, a number too
long to write) and one that fails while it runs: each request gets the answer it gets alone (hypothesis over random
batches), the valid ones the rows that pass."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from fields_engine import BOOM, HOLD, FieldsEngine, together_and_alone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from standin_service import standin_index

from cfir_jax.core.query_rule import conditions
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve import batcher as batcher_lib
from cfir_jax.serve.errors import http_answer
from cfir_jax.serve.metrics import Metrics

MAX_TOP_K = 12
ROWS = [{"tags": [["sport", "a,b"], ["news"], [], None][n % 4], "editorial": [True, False, None][n % 3],
         "date": ["2020-06-30T14:05:30", "2020-07-01", "2021-01-01T00:00"][n % 3], "n": float(n)}
        for n in range(12)]
KINDS = {"tags": "list", "editorial": "boolean", "date": "date", "n": "number"}
VALID = {  # a request's filter, and the rows that pass it
    "list": (["tags=sport"], [0, 4, 8]),
    "list-in": ([("tags", "in", ["a,b", "news"])], [0, 1, 4, 5, 8, 9]),
    "list-not": ([("tags", "!=", "sport")], [1, 2, 5, 6, 9, 10]),
    "bool-true": ([("editorial", "=", True)], [0, 3, 6, 9]),
    "bool-line": (["editorial=false"], [1, 4, 7, 10]),
    "date-month": (["date=2020-06"], [0, 3, 6, 9]),
    "date-year": ([("date", "<", 2021)], [0, 1, 3, 4, 6, 7, 9, 10]),
    "date-minute": (["date<=2020-06-30T14:05"], [0, 3, 6, 9]),
    "plain": ([], list(range(12))),
}
REFUSED = {  # a request's filter, and the status its refusal answers with
    "list-order": (["tags<x"], 422),
    "bool-neither": ([("editorial", "=", "maybe")], 422),
    "unknown-field": (["colour=red"], 422),
    "number-word": ([("n", ">", "many")], 422),
    "conditions": ([f"n>{k}" for k in range(17)], 413),
    "values": ([("tags", "in", [f"t{k}" for k in range(1_025)])], 413),
    "bytes": ([("tags", "=", "x" * 17_000)], 413),
}


def _job(loop, name: str, n: int) -> batcher_lib.Job:
    text, where = f"text of {name}", ()
    if name in VALID or name in REFUSED:
        where = conditions((VALID.get(name) or REFUSED[name])[0])
    elif name == "fails-running":
        text = BOOM
    else:
        text = HOLD
    doc = DocumentInput(text, f"{name}-{n}", where=where)
    return batcher_lib.Job([doc], "cfir", MAX_TOP_K, time.monotonic() + 30, loop.create_future(), loop)


async def _outcome(job: batcher_lib.Job):
    try:
        answer = await job.future
    except Exception as e:  # noqa: BLE001 - the outcome compared: its status and its line
        answered = http_answer(e)
        return ("error", answered[0], answered[1]) if answered else ("500", type(e).__name__, str(e))
    return "ok", [[h["image_id"] for h in json.loads(a)["hits"]] for a in answer]


@pytest.fixture(scope="module")
def batched():
    engine = FieldsEngine(ROWS, KINDS, MAX_TOP_K)
    loaded = SimpleNamespace(index=standin_index(engine, MAX_TOP_K), version=3, entity_pool=None)
    mb = batcher_lib.MicroBatcher(lambda: loaded, 64, 0.0, 256, Metrics())
    yield mb, engine
    mb.stop(5)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.sampled_from(sorted([*VALID, *REFUSED, "fails-running"])), min_size=2, max_size=7))
def test_a_batch_of_typed_filters_answers_each_as_alone(batched, names):
    mb, engine = batched

    together, alone = asyncio.run(together_and_alone(mb, engine, _job, names, _outcome))
    assert together == alone, names
    for name, outcome in zip(names, together):
        if name in VALID:
            assert outcome == ("ok", [[f"img-{r}" for r in VALID[name][1]]]), (name, outcome)
        elif name in REFUSED:
            assert outcome[:2] == ("error", REFUSED[name][1]), (name, outcome)
            assert "\n" not in outcome[2] and len(outcome[2]) < 300, outcome
        else:
            assert outcome[0] == "500", outcome


def test_typed_filters_in_one_batch_on_the_ray_front_answer_each_its_own_status():
    """The Ray engine's front (`cluster.front.FrontService`, as the gateway calls it through `cluster.deployments`):
    a list filter, an order on a list, a True triple, a filter past serve.max_filter_conditions and a month, sent
    together, answer 200, 422, 200, 413, 200, the valid ones the rows that pass."""
    from standin_service import StandInHolder

    from cfir_jax.cluster.deployments import _status
    from cfir_jax.cluster.front import FrontService

    engine = FieldsEngine(ROWS, KINDS, MAX_TOP_K)
    holder = StandInHolder(engine, MAX_TOP_K)
    holder.client, holder.target = None, SimpleNamespace(generation=1)
    follower = SimpleNamespace(period_s=3600.0, poll=lambda: None, stuck=lambda: "", last_error="")
    front = FrontService(holder, holder.current.index.config.serve, None, follower)
    names = ["list", "list-order", "bool-true", "conditions", "date-month"]

    async def run():
        held = asyncio.ensure_future(_status(front.answer([DocumentInput(HOLD, "hold")], "cfir", 5)))
        while not engine.batches:
            await asyncio.sleep(0.005)
        calls = [_status(front.answer([DocumentInput("t", name, where=conditions((VALID.get(name) or
                                                                                   REFUSED[name])[0]))],
                                      "cfir", MAX_TOP_K)) for name in names]
        answers = asyncio.gather(*calls)
        await asyncio.sleep(0.05)
        engine.gate.set()
        await held
        return await answers

    try:
        answers = asyncio.run(run())
    finally:
        asyncio.run(front.shutdown())
    assert [status for status, _, _ in answers] == [200, 422, 200, 413, 200], answers
    for name, (status, answer, _) in zip(names, answers):
        if status == 200:
            hits = json.loads(answer[0] if isinstance(answer, list) else answer)["hits"]
            assert [h["image_id"] for h in hits] == [f"img-{r}" for r in VALID[name][1]], name
