"""Open-loop load: requests arrive at a rate whatever the server's state (Poisson or gamma), and
the rate sweep that finds the highest rate still meeting the SLOs.

Arrival times are drawn up front from a seeded generator and awaited against absolute
deadlines, so a slow client never drifts the schedule. Gamma inter-arrivals with coefficient of
variation `cv` model burstier traffic (cv = 1 is Poisson). Each arrival is one single-turn
request from the workload mix, cycled in file order.
"""

from __future__ import annotations

import asyncio
import random
import time

from prescient.latency_bench.workloads import Workload


def arrival_offsets(rate: float, num: int, process: str = "poisson", cv: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `num` requests arrives (first at 0)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(num):
        out.append(t)
        if process == "poisson":
            t += rng.expovariate(rate)
        elif process == "gamma":
            shape = 1.0 / (cv * cv)
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        else:
            raise ValueError(f"unknown arrival process {process!r} (poisson, gamma)")
    return out


def run_open_loop(client, workloads: list[Workload], rate: float, num: int, tag: str, process: str = "poisson",
                  cv: float = 1.0, seed: int = 0, progress=None) -> dict:
    offsets = arrival_offsets(rate, num, process, cv, seed)

    async def one(i: int, w: Workload, start: float) -> None:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        await client.chat(list(w.messages), w.max_tokens, f"{tag}-{i}", None, workload=w.kind)
        if progress is not None:
            progress.update(1)

    async def main() -> None:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, workloads[i % len(workloads)], start) for i in range(num)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return {"rate_rps": rate, "process": process, "cv": cv if process == "gamma" else 1.0, "num_requests": num,
            "offered_duration_s": offsets[-1], "wall_s": time.perf_counter() - t0}


def best_rate(points: list[dict], target: float) -> float | None:
    """Highest swept rate whose SLO attainment reached `target`."""
    ok = [p["rate_rps"] for p in points if (p.get("slo_attainment") or 0) >= target]
    return max(ok) if ok else None
