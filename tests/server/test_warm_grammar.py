"""`ServerConfig.warm_grammar` (what `prescient serve` sets): the grammar compiler and its worker
processes start with the server, so the first constrained request does not wait for a worker's
start (~2.5 s each on 2 cores); apps built without it start none until a grammar is asked for."""

from __future__ import annotations

import time


def test_the_compile_workers_start_with_the_server_when_asked(make_tiny_server):
    cold = make_tiny_server()
    warm = make_tiny_server(warm_grammar=True)
    deadline = time.monotonic() + 120
    while not (warm.ctx.constraints._compiler is not None and warm.ctx.constraints._compiler._procs.ready_workers):
        assert time.monotonic() < deadline, "the grammar workers did not start with the server"
        time.sleep(0.1)
    assert cold.ctx.constraints._compiler is None  # no request asked for a grammar: nothing started


def test_the_compile_workers_wait_for_an_idle_engine():
    """`prescient serve` starts the workers once the engine has been idle a moment, not while
    a stream decodes (their start took ~40% of the first streams' speed on 2 cores): while the
    engine reports itself busy nothing is built; after it has idled `after_s`, the compiler is."""
    import asyncio

    from prescient.server.constraints import Constraints

    class Engine:  # what Constraints asks of the engine: the compiler, built once
        built = 0

        def grammar_compiler(self, backend):
            self.built += 1
            return object()

    async def run():
        engine, idle = Engine(), [0.0]
        c = Constraints(engine)
        task = asyncio.create_task(c.warm_when_idle(lambda: idle[0], after_s=1.0, poll_s=0.01))
        await asyncio.sleep(0.2)  # busy (0 s idle), then idle but not long enough
        assert engine.built == 0
        idle[0] = 0.9
        await asyncio.sleep(0.1)
        assert engine.built == 0 and not task.done()
        idle[0] = 1.0
        await asyncio.wait_for(task, 5)
        assert engine.built == 1 and c._compiler is not None
        # a grammar request that came first leaves nothing to warm
        engine2 = Engine()
        c2 = Constraints(engine2)
        await c2.compiler()
        await asyncio.wait_for(c2.warm_when_idle(lambda: 5.0, after_s=1.0), 5)
        assert engine2.built == 1

    asyncio.run(run())


def test_the_engine_says_how_long_it_has_been_idle(tiny_model_dir):
    """AsyncEngine.idle_seconds (what the warm-up waits on): growing while nothing runs, 0 from
    a submission until its request ends, then growing again from then."""
    import asyncio

    from prescient.runtime.async_engine import AsyncEngine
    from prescient.runtime.sampling_params import SamplingParams
    from tests.server.conftest import tiny_engine

    aengine = AsyncEngine(tiny_engine(tiny_model_dir))
    during = []  # read on the engine thread after each step: the request still running
    aengine.step_hooks.append(lambda engine, outputs, seconds: during.append(aengine.idle_seconds()))

    async def run():
        await asyncio.sleep(0.3)
        before = aengine.idle_seconds()
        assert before >= 0.2 and not during
        submitted = time.monotonic()
        outs = [o async for o in aengine.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0))]
        assert outs[-1].finished and len(during) > 1 and max(during) == 0.0
        deadline = time.monotonic() + 10
        while (after := aengine.idle_seconds()) < 0.1:  # growing again (never stuck at 0)
            assert time.monotonic() < deadline, "the idle time did not grow again after the request"
            await asyncio.sleep(0.01)
        # counted from the request's end, which came after `submitted`: at most the time since
        # then, however late this thread runs; counted from the first idle start it would be
        # over `before` (>= 0.2 s) more than that
        assert after <= time.monotonic() - submitted

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        aengine.shutdown()


def test_a_cancelled_caller_leaves_the_one_build_running():
    """The compiler is built once: a caller cancelled mid-build (a client gone, the warm-up
    stopped at shutdown) leaves the build running, and the next caller (or `settle`, before the
    server closes the compiler) gets its result, not a second build with its own workers; a
    build that failed is tried again."""
    import asyncio
    import threading

    from prescient.server.constraints import Constraints

    class Engine:
        def __init__(self, fail_first=False):
            self.built, self.fail_first = 0, fail_first
            self.go = threading.Event()

        def grammar_compiler(self, backend):
            self.go.wait(10)
            self.built += 1
            if self.fail_first and self.built == 1:
                raise RuntimeError("no workers")
            return object()

    async def run():
        engine = Engine()
        c = Constraints(engine)
        first = asyncio.create_task(c.compiler())
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        engine.go.set()
        await asyncio.wait_for(c.settle(), 10)
        got = await c.compiler()
        assert engine.built == 1 and got is c._compiler is not None

        engine = Engine(fail_first=True)
        engine.go.set()
        c = Constraints(engine)
        try:
            await c.compiler()
            raise AssertionError("the failed build was not reported")
        except RuntimeError:
            pass
        assert await c.compiler() is not None and engine.built == 2

    asyncio.run(run())
