"""A request's output constraint -> a grammar matcher for the engine.

`response_format` (Chat Completions) / `text.format` (Responses: json_schema, json_object, and the
`regex` / `grammar` extensions) or the tool-call grammar `tool_choice` asks for become a
`GrammarSpec` (prescient.grammar), compiled by the engine's compiler (`Engine.grammar_compiler()`,
cached per spec, so an agent's repeated tool list compiles once) in its low-priority worker
processes (grammar/compile_pool.py) while the handler awaits it without blocking the event loop
or holding a thread. The matcher goes to the engine with the request (`grammar=`), which masks
each step's logits with it.

The handler waits for the compile rather than handing the engine a pending one: a schema or
grammar that cannot be enforced exactly is then a 400 naming the field before anything streams,
and the engine thread never blocks on a compile while other requests wait for their next token.
The cost is the first compile of a new spec (~50-150 ms) on that request's TTFT; repeats are
cache hits. The compiler is built on first use (a ~0.5 s vocabulary scan, and its worker
processes: ~2.5 s to start, ~310 MB each, which unconstrained servers never pay).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from prescient.grammar import GrammarCompiler, GrammarError, GrammarSpec, spec_from_response_format
from prescient.server.errors import bad_request


def format_spec(fmt: dict | None, param: str) -> GrammarSpec | None:
    """Shape-check a response format (400 naming `param` when it is wrong)."""
    if fmt is None:
        return None
    try:
        return spec_from_response_format(fmt)
    except GrammarError as err:
        raise bad_request(str(err), param=_field(err.feature, fmt, param), code="invalid_response_format") from None


def _field(feature: str | None, fmt, param: str) -> str:
    """The request field a format error is about: GrammarError names it as `response_format.<key>`;
    Chat Completions nests the schema's keys under `json_schema`."""
    key = (feature or "").removeprefix("response_format").lstrip(".")
    if not key:
        return param
    if key == "schema" and isinstance(fmt, dict) and "json_schema" in fmt:
        return f"{param}.json_schema" + (".schema" if isinstance(fmt["json_schema"], dict) else "")
    return f"{param}.{key}"


def pick_spec(format_grammar: GrammarSpec | None, tool_grammar: GrammarSpec | None,
              format_param: str) -> GrammarSpec | None:
    if format_grammar is not None and tool_grammar is not None:
        raise bad_request("a structured output format cannot be combined with tools unless tool_choice is "
                          "'none'", param=format_param, code="unsupported_combination")
    return format_grammar or tool_grammar


class Constraints:
    def __init__(self, engine, metrics=None, backend: str = "xgrammar"):
        self._engine = engine
        self._backend = backend  # CompilerConfig.backend of the compiler built on first use
        self._metrics = metrics
        self._compiler: GrammarCompiler | None = None
        self._build: asyncio.Future | None = None  # the one build in flight (or done)

    async def compiler(self) -> GrammarCompiler:
        """The compiler, built once (on a thread: its vocabulary scan and worker starts). The build
        is one future every caller awaits shielded: a caller cancelled meanwhile (a client gone,
        the warm-up stopped) leaves it running, so its result is kept (and closed at shutdown)
        rather than dropped with its worker processes; a failed build is tried again next time."""
        if self._compiler is None:
            if self._build is None:
                self._build = asyncio.ensure_future(asyncio.to_thread(self._engine.grammar_compiler, self._backend))
            build = self._build
            try:
                compiler = await asyncio.shield(build)
            except Exception:
                if self._build is build:
                    self._build = None
                raise
            self._compiler = compiler
        return self._compiler

    async def settle(self) -> None:
        """Wait for a build in flight (before close(), so its workers are stopped too)."""
        build = self._build
        if build is not None:
            with contextlib.suppress(Exception):
                self._compiler = self._compiler or await asyncio.shield(build)

    async def warm_when_idle(self, idle_seconds: Callable[[], float], after_s: float, poll_s: float = 0.1) -> None:
        """Build the compiler (and start its worker processes) once `idle_seconds()` (the engine's,
        AsyncEngine.idle_seconds) reaches `after_s`, unless a grammar request built it first.
        A worker's start is ~2.5 s of CPU (xgrammar imports torch): begun with the server, the
        first requests decoded beside it, at nice 10 but still ~40% slower for their first
        seconds on 2 cores (the default model through `prescient serve`, first pass: 134-160
        against 229-264 tok/s with no workers starting). Cancelling it leaves a build it began
        running (`settle` waits for it)."""
        while self._compiler is None:
            if idle_seconds() >= after_s:
                await self.compiler()
                return
            await asyncio.sleep(poll_s)

    def close(self) -> None:
        """Stop the compiler's worker processes (server shutdown)."""
        if self._compiler is not None:
            self._compiler.close()

    async def matcher(self, spec: GrammarSpec | None, param: str):
        """A fresh matcher for `spec` (None: unconstrained); 400 naming `param` if refused."""
        if spec is None:
            return None
        compiler = await self.compiler()
        start = time.perf_counter()
        pending = compiler.submit(spec)
        try:
            compiled = pending.result() if pending.done() else await pending.wait()
        except GrammarError as err:
            raise bad_request(str(err), param=param, code="invalid_grammar") from None
        if self._metrics is not None:
            self._metrics.grammar_compile.observe(time.perf_counter() - start)
        matcher = compiled.matcher()
        if matcher.allows_nothing():  # it compiles, but no output could ever match it
            raise bad_request("the grammar allows no token at its start: no output can match it", param=param,
                              code="invalid_grammar")
        return matcher
