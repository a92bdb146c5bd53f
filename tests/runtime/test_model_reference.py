"""Our model's logits equal Hugging Face transformers' on the same weights.

Tiny random Llama and Qwen2 in float64 and the real default model in float32. Tolerances: tiny
models 1e-4 absolute (transformers computes its RoPE table and RMSNorm in float32 even for a
float64 model, ~1e-5 apart from our float64 math; a wrong RoPE layout or GQA mapping is off by
O(1)); the real model in float32 1e-3 absolute on logits of
magnitude ~20 (summation order differs between our fused projections and theirs).

The reference and its transformations: `LlamaModel.forward` reads no environment and takes no
CPU path; `prepare_for_cpu` (the native layers and the thread policy) gives the reference's
logits bit for bit (bfloat16) on decode- and prefill-sized forwards; drafts are made by
`early_exit` only, and nothing probes a model with hasattr."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from prescient.kernels import cpu_layer
from prescient.runtime.batch import SeqRows, build_forward_batch, pack_forward_batch
from prescient.runtime.env import FUSED_LAYERS, TP_STEP_TIMEOUT, RuntimeEnv, runtime_env
from prescient.runtime.linear import BATCH_INVARIANT_M
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel, prepare_for_cpu
from prescient.runtime.request import Request
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.scheduler import ScheduledSeq
from prescient.speculative.tree import DraftTree
from tests.conftest import make_tiny_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: runtime/, kernels/, ...
BLOCK = 16


def full_forward(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """All-position logits of one sequence through the paged path. -> [len, vocab]"""
    num_blocks = -(-len(token_ids) // block_size) + 1
    kv = model.allocate_kv_cache(num_blocks, block_size)
    req = Request("r", list(token_ids), SamplingParams(), (), 0.0)
    req.block_ids = list(range(num_blocks))
    batch = build_forward_batch([ScheduledSeq(req, len(token_ids), 0)], [None], block_size, model.device)
    batch.logits_indices = torch.arange(len(token_ids))
    return model.forward(batch, kv)


def hf_logits(path, token_ids, dtype=torch.float64, **kw) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    with torch.no_grad():
        return m(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {}),
])
def test_tiny_matches_transformers_float64(tmp_path, model_type, extra):
    path = make_tiny_checkpoint(tmp_path / "m", model_type, **extra)
    ckpt = load_checkpoint(str(path))
    model = LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)
    tokens = torch.randint(0, ckpt.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = full_forward(model, tokens)
    ref = hf_logits(str(path), tokens)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_paged_incremental_decode_equals_full_forward(tmp_path):
    """Prefill in chunks then decode token by token through the paged cache == one full forward."""
    path = make_tiny_checkpoint(tmp_path / "m")
    ckpt = load_checkpoint(str(path))
    model = LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)
    tokens = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    full = full_forward(model, tokens, block_size=8)
    kv = model.allocate_kv_cache(16, 8)
    req = Request("r", tokens, SamplingParams(), (), 0.0)
    req.block_ids = [5, 2, 9, 0, 11, 3, 7, 1, 4, 6]  # scattered blocks
    rows = []
    for chunk in [13, 20, 7] + [1] * 30:
        seq = ScheduledSeq(req, chunk, 0)
        batch = build_forward_batch([seq], [None], 8, model.device)
        start = req.num_computed_tokens
        batch.logits_indices = torch.arange(chunk)
        rows.append(model.forward(batch, kv))
        req.num_computed_tokens = start + chunk
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-9, rtol=1e-9)


@pytest.mark.slow
def test_default_model_matches_transformers(default_engine):
    from prescient.runtime.loader import default_model_path
    import os

    path = default_model_path()
    tok = default_engine.tokenizer
    tokens = tok.apply_chat_template([{"role": "user", "content": "Explain what a hash table is in two sentences."}])
    ours = full_forward(default_engine.model, tokens)
    ref = hf_logits(os.path.dirname(path), tokens, dtype=torch.float32, gguf_file=os.path.basename(path))
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# ---------------------------------------------------------------- the reference and its transformations

def _sources(*packages: str):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, path.read_text()


def test_the_reference_model_reads_no_environment():
    """runtime/model.py reads no environment variable; in runtime/ only env.py reads os.environ."""
    tree = ast.parse((ROOT / "runtime" / "model.py").read_text())
    for node in ast.walk(tree):
        assert not (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")), f"line {node.lineno}"
        assert not (isinstance(node, ast.Import) and any(a.name == "os" for a in node.names)), f"line {node.lineno}"
        assert not (isinstance(node, ast.ImportFrom) and node.module == "os"), f"line {node.lineno}"
    readers = [path.name for path, src in _sources("runtime") if re.search(r"\bos\.(environ|getenv)\b", src)]
    assert readers == ["env.py"]


def test_drafts_are_made_by_early_exit_and_models_are_not_probed():
    """No object.__new__ anywhere (LlamaModel.early_exit is the one way to make a draft of a
    model; TensorParallelModel.early_exit goes through its shard's), and no hasattr(...model...)
    probe in runtime/, speculative/ or prescient/ (ModelRunner.is_sharded says what a probe asked)."""
    for path, src in _sources("runtime", "speculative", "prescient", "kernels", "server", "grammar"):
        assert "object.__new__" not in src, path
    for path, src in _sources("runtime", "speculative", "prescient"):
        assert not re.search(r"hasattr\(\s*[\w.]*model\b", src), path


def test_runtime_env_parsing():
    assert RuntimeEnv.from_environ({}) == RuntimeEnv() == RuntimeEnv(True, False, 10.0)
    for off in ("0", "false", "off"):
        assert RuntimeEnv.from_environ({FUSED_LAYERS: off}).fused_layers is False
    assert RuntimeEnv.from_environ({FUSED_LAYERS: "layer"}) == RuntimeEnv(fused_layers=True, fused_per_layer=True)
    assert RuntimeEnv.from_environ({FUSED_LAYERS: ""}).fused_layers is True  # anything else: on, as before
    assert RuntimeEnv.from_environ({TP_STEP_TIMEOUT: "2.5"}).tp_step_timeout_s == 2.5
    with pytest.raises(ValueError, match=TP_STEP_TIMEOUT):
        RuntimeEnv.from_environ({TP_STEP_TIMEOUT: "soon"})


def test_runtime_env_follows_the_environment(monkeypatch):
    monkeypatch.delenv(FUSED_LAYERS, raising=False)
    first = runtime_env()
    assert first.fused_layers and runtime_env() is first  # parsed again only when a variable changed
    monkeypatch.setenv(FUSED_LAYERS, "0")
    assert runtime_env().fused_layers is False
    monkeypatch.setenv(FUSED_LAYERS, "layer")
    assert runtime_env().fused_per_layer is True


def _steps(vocab: int) -> list[tuple[str, list[SeqRows]]]:
    """A prefill-sized forward (more than one GEMV call's BATCH_INVARIANT_M rows), then
    decode-sized ones, all on the native layers when prepared: a short prompt, two decode
    tokens, a verify tree of 8 nodes beside a decode token."""
    g = torch.Generator().manual_seed(4)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    a, b = list(range(9)), [12, 10, 14]  # 144 and 48 KV positions
    n = BATCH_INVARIANT_M + 36
    tree = DraftTree(ids(8), [-1, 0, 0, 1, 2, 2, 3, 6])
    return [
        ("prefill", [SeqRows(ids(n), range(n), 0, a, None, range(n))]),
        ("short prompt", [SeqRows(ids(20), range(20), 0, b, None, [19])]),
        ("decode", [SeqRows(ids(1), [n], n, a, None, [0]), SeqRows(ids(1), [20], 20, b, None, [0])]),
        ("verify", [SeqRows(tree.tokens, [n + 1 + d for d in tree.depth], n + 1, a, tree.mask_bits(), range(8)),
                    SeqRows(ids(1), [21], 21, b, None, [0])]),
    ]


def _run_pair(model: LlamaModel, ref_model: LlamaModel, monkeypatch) -> tuple[list, list[int]]:
    """Each step through `model.forward` (prepared) and the reference on its own KV cache ->
    ([(name, num_tokens, prepared logits, reference logits)], the token counts of the native calls)."""
    from tests.kernels.test_cpu_layer import _record_native_calls

    sizes = _record_native_calls(monkeypatch)  # FusedLayers.forward or .logits (pl_forward)
    kv_cpu, kv_ref = model.allocate_kv_cache(16, BLOCK), ref_model.allocate_kv_cache(16, BLOCK)
    out = []
    for name, rows in _steps(model.config.vocab_size):
        batch = pack_forward_batch(rows, BLOCK, torch.device("cpu"))
        got = model.forward(batch, kv_cpu)
        # the reference right after: on the torch thread count the prepared forward chose
        want = LlamaModel.forward(ref_model, batch, kv_ref)
        out.append((name, batch.num_tokens, got, want))
    return out, sizes


@pytest.fixture
def tiny_ckpt(tiny_llama_dir, monkeypatch):
    if not cpu_layer.available():
        pytest.skip(f"native layers unavailable: {cpu_layer.why_not()}")
    for var in ("PRESCIENT_KERNELS", "PRESCIENT_CPU_ATTENTION", FUSED_LAYERS):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    yield load_checkpoint(str(tiny_llama_dir))
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_prepared_cpu_forward_gives_the_reference_logits(tiny_ckpt, dtype, monkeypatch):
    """prepare_for_cpu on the reference model: the same logits and KV bit for bit, bfloat16 and
    float32 (the same kernels, the same roundings between them, the native layer's SiLU in
    both), prefill-sized forwards included."""
    model = prepare_for_cpu(LlamaModel(tiny_ckpt.config, tiny_ckpt.weights, dtype=dtype, prepare=False), RuntimeEnv())
    out, sizes = _run_pair(model, model, monkeypatch)
    assert sizes == [BATCH_INVARIANT_M + 36, 20, 2, 9], "a forward did not run the native layers"
    for name, num_tokens, got, want in out:
        assert got.shape == want.shape and got.dtype == want.dtype == torch.float32, name
        assert torch.equal(got, want), f"{name}: {(got - want).abs().max().item():.3g}"


def test_the_default_model_is_prepared_and_follows_the_environment(tiny_ckpt, monkeypatch):
    """LlamaModel(...) keeps its behaviour (prepared on the CPU, PRESCIENT_FUSED_LAYERS read at
    each forward); prepare=False is the reference; a fixed RuntimeEnv overrides the environment."""
    cfg, w = tiny_ckpt.config, tiny_ckpt.weights
    assert LlamaModel(cfg, w, prepare=False).prepared is None
    model = LlamaModel(cfg, w, dtype=torch.bfloat16)
    assert model.prepared is not None and model.prepared.env is None
    monkeypatch.setenv(FUSED_LAYERS, "0")
    out, sizes = _run_pair(model, model, monkeypatch)
    assert sizes == [] and all(torch.equal(got, want) for _, _, got, want in out)
    monkeypatch.delenv(FUSED_LAYERS)
    assert _run_pair(model, model, monkeypatch)[1] == [BATCH_INVARIANT_M + 36, 20, 2, 9]
    monkeypatch.setenv(FUSED_LAYERS, "0")
    fixed = prepare_for_cpu(LlamaModel(cfg, w, dtype=torch.bfloat16, prepare=False), RuntimeEnv(fused_layers=True))
    assert _run_pair(fixed, fixed, monkeypatch)[1] == [BATCH_INVARIANT_M + 36, 20, 2, 9]


def test_the_thread_policy_lives_in_the_prepared_forward(tiny_ckpt, monkeypatch):
    """Every forward of a prepared model (decode-sized, prefill-sized, forward_layers) runs
    torch on one thread: the linears and attention run on the kernels' pool at every row count;
    the reference forward leaves the thread count alone."""
    model = LlamaModel(tiny_ckpt.config, tiny_ckpt.weights, dtype=torch.bfloat16)
    if not model.prepared.packed:
        pytest.skip("no packed GEMV kernel: the prepared forward sets no threads")
    steps = dict(_steps(model.config.vocab_size))
    kv = model.allocate_kv_cache(16, BLOCK)
    prefill = pack_forward_batch(steps["prefill"], BLOCK, torch.device("cpu"))
    short = pack_forward_batch(steps["short prompt"], BLOCK, torch.device("cpu"))
    saved = torch.get_num_threads()
    try:
        for run in (lambda: model.forward(short, kv), lambda: model.forward(prefill, kv),
                    lambda: model.forward_layers(prefill, kv, None, 0, 1)):
            torch.set_num_threads(2)
            run()
            assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        LlamaModel.forward(model, short, kv)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_early_exit_draft_carries_the_transformation(tiny_ckpt, monkeypatch):
    """The draft shares the target's tensors; its prepared forward runs its own layers, and
    gives its reference logits bit for bit."""
    target = LlamaModel(tiny_ckpt.config, tiny_ckpt.weights, dtype=torch.bfloat16)
    draft = target.early_exit(1)
    assert draft.num_layers == len(draft.layers) == 1 and draft.layers[0] is target.layers[0]
    assert draft.lm_head is target.lm_head and draft.embed is target.embed
    assert draft.prepared is not target.prepared and draft.prepared.env is target.prepared.env
    assert target.num_layers == 2
    out, sizes = _run_pair(draft, draft, monkeypatch)
    assert sizes == [BATCH_INVARIANT_M + 36, 20, 2, 9]
    assert all(torch.equal(got, want) for _, _, got, want in out)
    reference = LlamaModel(tiny_ckpt.config, tiny_ckpt.weights, dtype=torch.bfloat16, prepare=False).early_exit(1)
    assert reference.prepared is None
    full = _run_pair(target, target, monkeypatch)[0]
    assert not torch.equal(full[-1][2], out[-1][2])  # the target's 2 layers are not the draft's 1
