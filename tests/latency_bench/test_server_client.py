"""The load generators against a live server (uvicorn in a thread over a tiny engine) through the
Responses WebSocket client: agent sessions continue with previous_response_id, every request's
timings land in the tracker, and the server's engine ends with every KV block free or pinned."""

from __future__ import annotations

import pytest

from prescient.latency_bench.agent_loop import AgentLoadConfig, run_agents
from prescient.latency_bench.open_loop import run_open_loop
from prescient.latency_bench.server_client import ServerClient
from prescient.latency_bench.workloads import load_workloads, select
from prescient.runtime.slo import CPU_INTERACTIVE, SLOTracker


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    from prescient.build import EngineSpec, build_engine
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import EngineConfig
    from prescient.server.context import ServerConfig
    from tests.server.live import LiveServer

    config = EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=1024),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048))
    spec = EngineSpec(model=str(tiny_chat_model_dir), dtype="float32", speculate="off", progress=False)
    live = LiveServer(build_engine(spec, config=config),
                      ServerConfig(model_name="tiny"))
    yield live
    live.stop()


def test_agent_sessions_and_open_loop_over_websocket(server):
    workloads, _ = load_workloads()
    scripts = [w for w in workloads if w.kind == "tool_call"]
    tracker = SLOTracker(CPU_INTERACTIVE)
    client = ServerClient(server.url, tracker)
    agents = run_agents(client, scripts, AgentLoadConfig(num_agents=2, sessions_per_agent=1, turns=3,
                                                         tool_latency_s=0.01, max_tokens=5), "ws")
    assert agents["completed_tasks"] == 2
    s = tracker.summary()
    assert s["num_requests"] == 6 and s["num_output_tokens"] == 6 * 5
    # a delta can carry several tokens (held-back text, accepted drafts): those share one TTFT or gap
    assert s["ttft_s"]["count"] == 6 and 0 < s["itl_token_s"]["count"] <= 6 * 4

    tracker = SLOTracker(CPU_INTERACTIVE)
    run_open_loop(ServerClient(server.url, tracker), select(workloads, 1, 4), rate=20.0, num=3, tag="ws-open")
    assert tracker.summary()["num_requests"] == 3
    state = server.engine_state()
    assert state["requests"] == 0 and state["running"] == 0
