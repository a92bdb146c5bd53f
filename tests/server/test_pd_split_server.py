"""`--pd-split` through the server and the official SDK (the tiny model, a real prefill worker
process): streamed chat and strict json_schema output equal the co-located server's, token for
token, and /metrics reports the handoffs and the TTFT split."""

from __future__ import annotations

import json

import openai
import pytest

from prescient.server.context import ServerConfig
from tests.server.live import LiveServer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def split_server(tiny_model_dir):
    from prescient.build import EngineSpec, build_engine
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import EngineConfig
    from prescient.runtime.tp_worker import _set_threads

    config = EngineConfig(dtype="float64", cache=CacheConfig(num_blocks=512),
                          scheduler=SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=2048))
    spec = EngineSpec(model=str(tiny_model_dir), dtype="float64", speculate="off", calibrate="off",
                      progress=False, pd_split=True)
    before = _set_threads(1)  # the split shares the cores out; give them back afterwards
    server = LiveServer(build_engine(spec, config=config), ServerConfig(model_name="tiny"))
    yield server
    server.stop()
    _set_threads(before[0])
    if before[1] is not None:
        from prescient.kernels import cpu_linear

        cpu_linear.set_num_threads(before[1])


def _chat(url: str, stream: bool, **kw) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Give me a name and a number."}]
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=40, **kw)
        return r.choices[0].message.content
    parts = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=40,
                                           stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def test_split_server_equals_colocated(split_server, tiny):
    assert _chat(split_server.url, stream=True) == _chat(tiny.url, stream=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    got = _chat(split_server.url, stream=False, response_format=fmt)
    assert got == _chat(tiny.url, stream=False, response_format=fmt)
    json.loads(got)
    import urllib.request

    metrics = urllib.request.urlopen(f"{split_server.url}/metrics", timeout=10).read().decode()
    handoffs = [line for line in metrics.splitlines() if line.startswith("prescient_pd_handoffs_total")]
    assert handoffs and float(handoffs[0].split()[-1]) >= 2
    assert 'prescient_pd_ttft_seconds_total{part="transfer"}' in metrics
