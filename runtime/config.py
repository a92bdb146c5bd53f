"""Model and engine configuration: small frozen dataclasses, validated on construction.

`ModelConfig` is read from a Hugging Face `config.json` or from GGUF metadata (runtime/loader.py)
and describes a Llama-family decoder (Llama, SmolLM2, Qwen2). `EngineConfig` holds the serving
knobs; each component receives only its own sub-config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as in HF `rope_scaling` / `rope_parameters`: default, linear, llama3, yarn."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r} "
                             "(supported: default, linear, llama3, yarn)")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "model") -> "ModelConfig":
        arch = cfg.get("model_type", "")
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0) if rope else 10000.0)
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=rope.get("original_max_position_embeddings"),
            beta_fast=float(rope.get("beta_fast", 32.0)),
            beta_slow=float(rope.get("beta_slow", 1.0)),
        )
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            name=name,
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    kv_dtype: str | None = None  # None: the model's dtype; "int8": int8 rows + a scale per token and head

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_dtype not in (None, "int8"):
            raise ValueError(f"kv_dtype must be None (the model's dtype) or 'int8', got {self.kv_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching knobs, and the bounds of the waiting queue (runtime/scheduler.py).

    A request that fits the KV cache only once others finish waits, but not without bound: past
    `max_waiting` queued requests a new one is refused, and one not started within
    `max_queue_wait_s` is ended; both as "overloaded", with `retry_after_s` as the hint the
    server passes on (HTTP 429 + Retry-After). The defaults are for a 2-core CPU server: 256 is
    the server's default `max_connections`, so the queue bound is reached only by a flood the
    connection cap does not stop; 30 s is about one default-length (1024-token) reply at ~30 ms
    a token, so a request not started by then is better told to come back than left waiting
    into its client's timeout; 5 s is a fraction of that wait.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_waiting: int = 256  # requests queued and not yet running (preempted ones always return)
    max_queue_wait_s: float = 30.0  # from arrival to first scheduled, else "overloaded"
    retry_after_s: float = 5.0  # the hint an overloaded refusal carries
    # Later requests admitted past a waiting one that does not fit yet (no head-of-line wedge);
    # after that many, admission waits for it while the running requests finish (no starvation).
    max_overtakes: int = 32
    # Steps sized by time (runtime/scheduler.py, docs/SCHEDULING.md): a step carrying prefill
    # work is kept within `itl_margin` x the tightest ITL bound among the decoding requests
    # (their `max_itl_s`, else `itl_target_s`); waiting prompts start earliest TTFT deadline
    # first (their `max_ttft_s`, else `ttft_target_s`). None: no time budget (tokens only).
    itl_target_s: float | None = 0.1
    ttft_target_s: float = 1.0
    itl_margin: float = 0.8
    # A prompt is cut into chunks of `prefill_chunk` tokens (a last piece of at most
    # BATCH_INVARIANT_M tokens joins the chunk before it), whatever else runs: the same cuts alone
    # and under load, and each chunk in a forward of its own. With the kernels loaded a row's bits
    # do not depend on the cuts; on the fallback GEMM path the same cuts keep the same KV bits.
    prefill_chunk: int = 512
    # A chunk whose full cost would break the ITL budget runs a few of its layers per step.
    layer_split: bool = True
    # The planned layers of a split chunk are a prediction: the step runs them after its decode
    # rows and starts no more of them where they would end the step (its sampling and commit
    # priced at the last step's) past `itl_cutoff` x the ITL bound (they run in later steps), so
    # a step slower than predicted (a noisy host) is cut short instead of breaking every
    # stream's bound (runtime/forward_plan.py). Below `itl_margin` it counts as `itl_margin`.
    itl_cutoff: float = 0.9

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be >= 16")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.max_overtakes < 0:
            raise ValueError("max_overtakes must be >= 0")
        if self.itl_target_s is not None and not self.itl_target_s > 0:
            raise ValueError("itl_target_s must be > 0 (or None: no time budget)")
        if not 0 < self.itl_margin <= 1:
            raise ValueError("itl_margin must be in (0, 1]")
        if not 0 < self.itl_cutoff <= 1:
            raise ValueError("itl_cutoff must be in (0, 1] (below itl_margin it counts as itl_margin)")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")  # and above BATCH_INVARIANT_M: Scheduler checks
        for name in ("max_queue_wait_s", "retry_after_s", "ttft_target_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
