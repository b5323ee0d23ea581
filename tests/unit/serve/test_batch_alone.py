"""A request fails alone (issue 58): requests gathered into one micro-batch, some refused (an unknown field, a value of
the wrong type, top_k past the index, a language that is no code, a filter past its limits) and one failing while
its batch runs, each get the answer they get alone (hypothesis over random batches); the Ray engine's front runs the
same Service and answers the same statuses; a 10,000-value `in` beside a valid request is refused or answered
within a second and delays it by no more. Before, the first refusal found inside the batch answered every request of
it, and an `in` list walked the field's whole vocabulary once per value on the batcher's one thread."""

import asyncio
import concurrent.futures
import json
import time
from types import SimpleNamespace

import pytest
from fields_engine import BOOM, HOLD, FieldsEngine, together_and_alone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from standin_service import StandInHolder, serving, standin_index

import cfir_jax
from cfir_jax.api.client import ServiceError
from cfir_jax.core.query_rule import Condition
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve import batcher as batcher_lib
from cfir_jax.serve.metrics import Metrics

MAX_TOP_K = 10
ROWS = [{"license": ["cc0", "cc-by", "a,b"][n % 3], **({"n": n} if n % 4 else {})} for n in range(12)]
KINDS = {"license": "string", "n": "number"}
REQUESTS = {  # a request's documents' text and options: valid ones, refused ones, one that fails while it runs
    "valid": dict(where=(Condition("license", "in", ("cc0", "a,b")),)),
    "valid-number": dict(where=(Condition("n", ">=", ("5",)),), top_k=3),
    "valid-plain": dict(),
    "unknown-field": dict(where=(Condition("colour", "=", ("red",)),)),
    "wrong-type": dict(where=(Condition("n", ">", ("many",)),)),
    "top-k": dict(top_k=MAX_TOP_K + 1),
    "lang": dict(lang="not a code"),
    "too-many-values": dict(where=(Condition("license", "in", tuple(f"v{n}" for n in range(2000))),)),
    "fails-running": dict(text=BOOM),
}


def _job(loop, name: str, n: int) -> batcher_lib.Job:
    spec = REQUESTS.get(name, {"text": HOLD})
    doc = DocumentInput(spec.get("text", f"text of {name}"), f"{name}-{n}", lang=spec.get("lang"),
                        where=spec.get("where", ()))
    return batcher_lib.Job([doc], "cfir", spec.get("top_k", MAX_TOP_K), time.monotonic() + 30, loop.create_future(),
                           loop)


async def _outcome(job: batcher_lib.Job):
    try:
        answer = await job.future
    except Exception as e:  # noqa: BLE001 - the outcome compared: its kind and its line
        return type(e).__name__, str(e)
    return "ok", [{k: v for k, v in json.loads(a).items() if k != "times_ms"} for a in answer]


@pytest.fixture(scope="module")
def batched():
    """(a micro-batcher over the fields engine's index, the engine)."""
    engine = FieldsEngine(ROWS, KINDS, MAX_TOP_K)
    loaded = SimpleNamespace(index=standin_index(engine, MAX_TOP_K), version=3, entity_pool=None)
    mb = batcher_lib.MicroBatcher(lambda: loaded, 64, 0.0, 256, Metrics())
    yield mb, engine
    mb.stop(5)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.sampled_from(sorted(REQUESTS)), min_size=2, max_size=6))
def test_each_request_of_a_batch_gets_what_it_gets_alone(batched, names):
    mb, engine = batched

    together, alone = asyncio.run(together_and_alone(mb, engine, _job, names, _outcome))
    assert together == alone, names
    for name, (kind, _) in zip(names, together):
        assert (kind == "ok") == name.startswith("valid"), (name, kind)


def test_a_refusal_in_a_batch_is_its_request_s_alone_on_the_ray_front_too():
    """The Ray engine's front (`cluster.front.FrontService`, the Service the gateway calls through
    `cluster.deployments`) runs this batcher: three requests of one batch, one with an unknown field, answer
    200, 422, 200."""
    from cfir_jax.cluster.deployments import _status
    from cfir_jax.cluster.front import FrontService

    engine = FieldsEngine(ROWS, KINDS, MAX_TOP_K)
    holder = StandInHolder(engine, MAX_TOP_K)
    holder.client, holder.target = None, SimpleNamespace(generation=1)
    follower = SimpleNamespace(period_s=3600.0, poll=lambda: None, stuck=lambda: "", last_error="")
    front = FrontService(holder, holder.current.index.config.serve, None, follower)

    async def run():
        held = asyncio.ensure_future(_status(front.answer([DocumentInput(HOLD, "hold")], "cfir", 5)))
        while not engine.batches:
            await asyncio.sleep(0.005)
        asked = [(("license", "=", ("cc0",)),), (("colour", "=", ("red",)),), ()]
        calls = [_status(front.answer([DocumentInput("t", f"q{n}", where=tuple(Condition(*c) for c in where))],
                                      "cfir", 5)) for n, where in enumerate(asked)]
        answers = asyncio.gather(*calls)
        await asyncio.sleep(0.05)
        engine.gate.set()
        await held
        return await answers

    try:
        answers = asyncio.run(run())
    finally:
        asyncio.run(front.shutdown())
    assert [status for status, _, _ in answers] == [200, 422, 200]
    assert answers[1][1].startswith("filter 'colour=red': unknown field 'colour'")
    assert engine.batches == [["hold"], ["q0"], ["q2"]]  # one batch (a filter's documents together), q1 never in it


def test_a_10000_value_filter_beside_a_valid_request_delays_it_by_no_more_than_a_second():
    vocab = [f"value {n:06d}, \"quoted\"" for n in range(100_000)]
    rows = [{"license": vocab[n]} for n in range(100_000)]
    wanted = ["license", "in", vocab[:5_000] + [f"absent {n}" for n in range(5_000)]]
    for limits, status in [({}, 413), (dict(max_filter_values=20_000, max_filter_bytes=1 << 20), 200)]:
        with serving(retriever=FieldsEngine(rows, max_top_k=50), max_top_k=50, **limits) as (url, _, _):
            client = cfir_jax.Client(url)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # sent together: one batch, or the big one refused
                t0 = time.perf_counter()
                big = pool.submit(_timed, client, [wanted])
                beside = pool.submit(_timed, client, [("license", "=", vocab[7])])
                (big, big_s), (beside, beside_s) = big.result(), beside.result()
        assert beside.ids == ["img-7"] and beside_s < 1.0, (status, beside_s)
        assert big_s < 1.0 and time.perf_counter() - t0 < 2.0, (status, big_s)
        if status == 413:
            assert isinstance(big, ServiceError) and big.status == 413, big
            assert "10,000 values, over serve.max_filter_values=1,024" in str(big)
        else:
            assert big.ids == [f"img-{n}" for n in range(5)]


def _timed(client, where):
    t0 = time.perf_counter()
    try:
        answer = client.search("a text", top_k=5, where=where)
    except ServiceError as e:
        answer = e
    return answer, time.perf_counter() - t0
