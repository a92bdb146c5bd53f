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
