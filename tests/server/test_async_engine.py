"""The engine thread on its own, without HTTP: an engine error fails its request alone and not the loop,
and stopping aborts what is in flight."""

import asyncio

import pytest

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.server.async_engine import AsyncEngine, EngineFailed, EngineStopped

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_checkpoint):
    # max_logprobs past the vocabulary lets a request through whose sampling fails (top-k of too many).
    return Engine(EngineConfig(str(tiny_checkpoint("llama")[0]), dtype="float32", max_model_len=256,
                               max_logprobs=10**6))


async def until_idle(async_engine: AsyncEngine) -> None:
    for _ in range(1000):
        stats = async_engine.stats
        if stats.num_running == stats.num_waiting == stats.num_pages_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {async_engine.stats}")


def test_an_engine_error_fails_its_request_alone_and_the_loop_serves_on(engine, tiny_checkpoint):
    expected = LLM(tiny_checkpoint("llama")[0], dtype="float32").generate("The page pool", GREEDY, use_tqdm=False)

    async def scenario():
        async_engine = AsyncEngine(engine, max_waiting=8)
        async_engine.start()
        try:
            beside = await async_engine.add("The page pool", GREEDY, "beside", True)
            # More log-probabilities than the vocabulary has: the sampler's top-k raises inside the step.
            broken = await async_engine.add("The page pool", SamplingParams(max_tokens=4, logprobs=10**6), "bad", False)
            with pytest.raises(EngineFailed, match="the engine failed while running this request: RuntimeError"):
                await broken.result()
            beside_ids = (await beside.result()).outputs[0].token_ids
            await until_idle(async_engine)
            handle = await async_engine.add("The page pool", GREEDY, "good", False)
            return beside_ids, (await handle.result()).outputs[0].token_ids, async_engine.stats
        finally:
            await async_engine.stop()

    beside_ids, token_ids, stats = asyncio.run(scenario())
    assert beside_ids == token_ids == expected[0].outputs[0].token_ids
    assert stats.failed == 1 and stats.num_pages_used == 0 and stats.finished["error"] == 1


def test_abort_frees_the_pages_at_once(engine):
    async def scenario():
        async_engine = AsyncEngine(engine, max_waiting=8)
        async_engine.start()
        try:
            handle = await async_engine.add("The page pool", SamplingParams(max_tokens=200, ignore_eos=True), "r", True)
            first = await anext(handle)
            assert not first.finished and async_engine.stats.num_pages_used > 0
            handle.abort()
            await until_idle(async_engine)
            return async_engine.stats
        finally:
            await async_engine.stop()

    stats = asyncio.run(scenario())
    assert stats.finished["abort"] == 1 and stats.generated_tokens < 200


def test_stop_aborts_what_is_in_flight_and_refuses_new_requests(engine):
    async def scenario():
        async_engine = AsyncEngine(engine, max_waiting=8)
        async_engine.start()
        handles = [await async_engine.add("The page pool", SamplingParams(max_tokens=200, ignore_eos=True), str(i),
                                          True) for i in range(3)]
        await anext(handles[0])
        await async_engine.stop()
        for handle in handles:
            with pytest.raises(EngineStopped):
                async for _ in handle:
                    pass
        with pytest.raises(EngineStopped):
            await async_engine.add("The page pool", GREEDY, "late", False)
        return async_engine

    async_engine = asyncio.run(scenario())
    assert not async_engine.is_running
    assert async_engine.stats.num_pages_used == 0 and not engine.has_unfinished()
