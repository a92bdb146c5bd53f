"""Per-request sampling parameters: a small frozen dataclass validated on construction.

A temperature below `GREEDY_TEMPERATURE` (1e-5, so 0 too) means greedy everywhere (plain
decoding and speculative verification alike): dividing logits by a tiny one overflows to
inf/NaN in float32 (1e-300 does), and at 1e-5 sampling is already argmax for any logit gap
above ~1e-3, so the cut changes nothing else.

`seed` is a signed 64-bit integer, -2**63 <= seed < 2**63 (the bounds of OpenAI's API spec,
negatives included); the sampler maps it onto torch's unsigned 64-bit generator seed as
`seed % 2**64`, one to one. Bad values raise `ValueError` with a message naming the field
first, at `add_request` time.
"""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# Stop strings are scanned on the engine thread after every step, so one request's list bounds
# everyone's step time: OpenAI's 4, each at most 256 characters (longer stops are sentences).
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
# logit_bias as OpenAI: values in [-100, 100] (-100 bans a token, 100 forces it); at most one
# entry per vocabulary token, and a bounded count so building the bias row stays cheap.
LOGIT_BIAS_RANGE = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0: chosen token's logprob + top-k alternatives
    # OpenAI's penalties over the tokens generated so far (runtime/penalties.py), in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Where the request may use speculation at all (a caller can switch it off per request).
    speculate: bool = True
    # The request's own bound on its per-emission gaps (seconds; the server's `slo.itl_ms`):
    # the draft planner keeps a verify step's predicted time under it. None: no bound.
    max_itl_s: float | None = None
    # The request's own bound on its time to first token (seconds; the server's `slo.ttft_ms`):
    # the scheduler admits waiting prompts earliest deadline first. None: the scheduler's default.
    max_ttft_s: float | None = None
    # Whose shared pool of recent outputs may draft for it and learns its output (the server:
    # a digest of the API key); None: no shared pool.
    tenant: str | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before the grammar mask
    # and temperature (runtime/penalties.py), in every row of a draft tree so verification stays
    # exact. Token ids are checked against the model's vocabulary at Engine.make_request.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(e) for e in self.logit_bias))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
               "max_tokens must be an integer")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(isinstance(self.temperature, (int, float)), "temperature must be a number")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and SEED_MIN <= self.seed <= SEED_MAX),
               f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check(len(self.stop) <= MAX_STOP_SEQUENCES,
               f"stop has {len(self.stop)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", f"stop must be non-empty strings, got {s!r:.40}")
            _check(len(s) <= MAX_STOP_CHARS,
                   f"stop sequences may be at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
               f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
        for entry in self.logit_bias:
            _check(isinstance(entry, tuple) and len(entry) == 2, f"logit_bias entries must be (token id, bias) pairs")
            t, b = entry
            _check(isinstance(t, int) and not isinstance(t, bool) and t >= 0,
                   f"logit_bias keys must be token ids >= 0, got {t!r}")
            _check(isinstance(b, (int, float)) and not isinstance(b, bool)
                   and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE,
                   f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        _check(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias names a token twice")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, f"stop_token_ids must be token ids >= 0, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and -2 <= value <= 2,
                   f"{name} must be a number in [-2, 2], got {value!r}")
        _check(isinstance(self.speculate, bool), f"speculate must be true or false, got {self.speculate!r}")
        _check(self.max_itl_s is None or (isinstance(self.max_itl_s, (int, float)) and not isinstance(self.max_itl_s, bool)
                                          and 0 < self.max_itl_s < float("inf")),
               f"max_itl_s must be a number > 0, got {self.max_itl_s!r}")
        _check(self.max_ttft_s is None or (isinstance(self.max_ttft_s, (int, float)) and not isinstance(self.max_ttft_s, bool)
                                           and 0 < self.max_ttft_s < float("inf")),
               f"max_ttft_s must be a number > 0, got {self.max_ttft_s!r}")
        _check(self.tenant is None or isinstance(self.tenant, str), f"tenant must be a string, got {self.tenant!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
