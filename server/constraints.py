"""A request's output constraint -> a grammar matcher for the engine.

`response_format` (Chat Completions) / `text.format` (Responses: json_schema, json_object, and the
`regex` / `grammar` extensions) or the tool-call grammar `tool_choice` asks for become a
`GrammarSpec` (prescient.grammar), compiled on grammar/'s background pool (cached per spec) while
the handler awaits it without blocking the event loop. The matcher goes to the engine with the
request (`grammar=`), which masks each step's logits with it. A schema or grammar that cannot be
enforced exactly is a 400 naming the field, before anything streams.

The compiler is built on first use: the vocabulary scan takes ~0.5 s and unconstrained servers
never pay it.
"""

from __future__ import annotations

import asyncio
import time

from prescient.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarTokenizer, spec_from_response_format
from prescient.server.errors import bad_request


def format_spec(fmt: dict | None, param: str) -> GrammarSpec | None:
    """Shape-check a response format (400 naming `param` when it is wrong)."""
    if fmt is None:
        return None
    try:
        return spec_from_response_format(fmt)
    except GrammarError as err:
        raise bad_request(str(err), param=param, code="invalid_response_format") from None


def pick_spec(format_grammar: GrammarSpec | None, tool_grammar: GrammarSpec | None, format_param: str) -> GrammarSpec | None:
    if format_grammar is not None and tool_grammar is not None:
        raise bad_request("a structured output format cannot be combined with tools unless tool_choice is "
                          "'none'", param=format_param, code="unsupported_combination")
    return format_grammar or tool_grammar


class Constraints:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], metrics=None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._metrics = metrics
        self._compiler: GrammarCompiler | None = None
        self._lock = asyncio.Lock()

    async def compiler(self) -> GrammarCompiler:
        async with self._lock:
            if self._compiler is None:
                self._compiler = await asyncio.to_thread(self._build)
        return self._compiler

    def _build(self) -> GrammarCompiler:
        gtok = GrammarTokenizer.from_huggingface(self._tokenizer.hf, vocab_size=self._vocab_size,
                                                 stop_token_ids=list(self._stop_token_ids))
        return GrammarCompiler(gtok)

    async def matcher(self, spec: GrammarSpec | None, param: str):
        """A fresh matcher for `spec` (None: unconstrained); 400 naming `param` if refused."""
        if spec is None:
            return None
        compiler = await self.compiler()
        start = time.perf_counter()
        pending = compiler.submit(spec)
        try:
            compiled = pending.result() if pending.done() else await asyncio.to_thread(pending.result)
        except GrammarError as err:
            raise bad_request(str(err), param=param, code="invalid_grammar") from None
        if self._metrics is not None:
            self._metrics.grammar_compile.observe(time.perf_counter() - start)
        return compiled.matcher()

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
