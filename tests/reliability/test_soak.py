"""The soak (tests/reliability/soak.py) against a `prescient serve` subprocess. In CI: the tiny
model, 6 agents, 20 s. With `--soak MINUTES`: the default model, 32 agents, that long (the
issue's soak is `--soak 30`); its figures are printed (run with -s to see them)."""

from __future__ import annotations

import http.client
import json
import time

from tests.reliability.soak import SoakStats, metric, rss_bytes, run_soak
from tests.server.live import ServeProcess


def test_mixed_agents_leave_no_leak_and_every_stream_adds_up(tiny_model_dir, request):
    minutes = request.config.getoption("--soak")
    if minutes:
        seconds, agents, max_tokens, model = float(minutes) * 60, 32, 64, []
    else:
        seconds, agents, max_tokens, model = 20.0, 6, 24, ["--model", str(tiny_model_dir), "--dtype", "float32"]
    proc = ServeProcess(*model, "--session-ttl-s", "3", "--quiet", "--max-connections", "256")
    try:
        url = proc.url
        warm = SoakStats()
        # warm-up: the allocator's pools, caches; the KV cache is made resident at start (runtime/memory.py)
        run_soak(url, min(180.0, seconds / 10), agents, max_tokens, warm)
        rss_warm = rss_bytes(proc.proc.pid)
        store_warm = metric(url, "prescient_response_store_bytes")
        stats = SoakStats()
        t0 = time.monotonic()
        run_soak(url, seconds, agents, max_tokens, stats)
        elapsed = time.monotonic() - t0
        time.sleep(4)  # past the session pins' TTL; one request then runs a step, which expires them
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": "default", "messages": [{"role": "user", "content": "done"}], "max_tokens": 1}),
            headers={"content-type": "application/json"})
        assert conn.getresponse().status == 200
        rss_end = rss_bytes(proc.proc.pid)
        kv = metric(url, "prescient_kv_cache_usage_ratio")
        running = metric(url, "prescient_num_requests_running")
        waiting = metric(url, "prescient_num_requests_waiting")
        store_end = metric(url, "prescient_response_store_bytes")
        print(f"\nsoak: {elapsed:.0f} s, {agents} agents, {stats.streams} streams ({stats.by_kind} sessions), "
              f"{stats.dropped} dropped on purpose, {stats.tokens} tokens; RSS after warm-up "
              f"{rss_warm / 2**20:.0f} MiB, at the end {rss_end / 2**20:.0f} MiB "
              f"({(rss_end / rss_warm - 1) * 100:+.1f}%); stored responses {store_warm / 2**20:.1f} -> "
              f"{store_end / 2**20:.1f} MiB; KV usage {kv:.3f}, running {running:.0f}, "
              f"waiting {waiting:.0f}")
        assert not warm.failures and not stats.failures, (warm.failures + stats.failures)[:10]
        assert stats.streams > agents and stats.dropped > 0
        assert rss_end <= 1.10 * rss_warm
        assert running == 0 and waiting == 0 and kv == 0.0
    finally:
        proc.kill()
