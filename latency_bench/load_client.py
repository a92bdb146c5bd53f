"""A chat client for the load generators: one streamed request, its timings fed to an SLOTracker.

The agent loop and the open-loop driver talk to this interface only (`await client.chat(messages,
...)` -> reply text), so the same load runs against an in-process `AsyncEngine` here or a running
server (server_client.py). In-process, emissions carry the engine's own perf_counter stamps, and a
step hook on the engine thread records when each request was first scheduled (queue time).
"""

from __future__ import annotations

import time

from prescient.runtime.async_engine import AsyncEngine
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.slo import SLOTracker


class InProcessClient:
    def __init__(self, engine, tracker: SLOTracker):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.tracker = tracker
        self.async_engine = AsyncEngine(engine)
        self.num_steps = 0
        self.step_seconds = 0.0
        self.step_seqs = 0
        self.async_engine.step_hooks.append(self._on_step)

    def _on_step(self, engine, outputs, seconds: float) -> None:
        # engine thread: finished requests are already gone from engine.requests, the rest are not
        self.num_steps += 1
        self.step_seconds += seconds
        self.step_seqs += len(outputs)
        for out in outputs:
            request = engine.requests.get(out.request_id)
            if request is not None and request.first_scheduled_time is not None:
                self.tracker.on_scheduled(out.request_id, request.first_scheduled_time)

    async def chat(self, messages: list[dict], max_tokens: int, request_id: str, session_id: str | None = None,
                   **tags) -> str:
        ids = self.tokenizer.apply_chat_template(messages)
        self.tracker.on_arrival(request_id, time.perf_counter(), num_prompt_tokens=len(ids), **tags)
        tokens: list[int] = []
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        async for out in self.async_engine.generate(ids, params, request_id=request_id, session_id=session_id):
            if out.error:
                self.tracker.on_finish(request_id)
                raise RuntimeError(f"{request_id}: {out.error}")
            self.tracker.on_output(out)
            tokens.extend(out.new_token_ids)
        return self.tokenizer.decode(tokens)

    async def end_session(self, session_id: str) -> None:
        """The agent is done with the conversation (the engine's pin expires on its own TTL)."""

    def engine_stats(self) -> dict:
        return {"num_steps": self.num_steps,
                "mean_step_ms": 1e3 * self.step_seconds / self.num_steps if self.num_steps else None,
                "mean_outputs_per_step": self.step_seqs / self.num_steps if self.num_steps else None}

    def close(self) -> None:
        self.async_engine.shutdown()
