"""Server test fixtures: a tiny random model that speaks the real tokenizer, served live.

The tiny model (hidden 64, 2 layers, float64 so greedy output does not depend on batch
composition) has SmolLM2's 49152-token vocabulary and its tokenizer files, so chat templates,
detokenization, tool grammars and every protocol path are the real ones at a few ms per token.
Its text is gibberish: tests on it check protocol behavior, never content. Tests that need
sensible output use the real model (test_real_model.py, marked slow).
"""

from __future__ import annotations

import os
import shutil

import pytest

from prescient.server.context import ServerConfig
from tests.conftest import make_tiny_checkpoint
from tests.server.live import LiveServer

TINY_CONTEXT = 1024


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory):
    from prescient.runtime.loader import default_model_path
    from prescient.runtime.tokenizer import Tokenizer

    gguf = default_model_path()
    tokenizer = Tokenizer.load(os.path.dirname(gguf), os.path.basename(gguf))
    out = tmp_path_factory.mktemp("smol_tokenizer")
    tokenizer.hf.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(smol_tokenizer_dir, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-chat", vocab_size=49152,
                                max_position_embeddings=TINY_CONTEXT, bos_token_id=1, eos_token_id=2)
    for f in smol_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def tiny_engine(path, num_blocks: int = 512, speculate: str = "off", **scheduler):
    """`scheduler`: SchedulerConfig fields over the tiny defaults (48 sequences, 2048 tokens a step)."""
    from prescient.build import EngineSpec, build_engine
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import EngineConfig

    config = EngineConfig(dtype="float64", cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(**{"max_num_seqs": 48, "max_num_batched_tokens": 2048,
                                                       **scheduler}))
    spec = EngineSpec(model=str(path), dtype="float64", speculate=speculate, calibrate="now", progress=False)
    return build_engine(spec, config=config)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """The shared tiny server (default config)."""
    server = LiveServer(tiny_engine(tiny_model_dir), ServerConfig(model_name="tiny"))
    yield server
    server.stop()


@pytest.fixture
def make_tiny_server(tiny_model_dir):
    """A tiny server with its own engine and config, stopped after the test; `engine` takes
    tiny_engine's keywords (num_blocks, SchedulerConfig fields)."""
    servers = []

    def make(send_buffer: int | None = None, speculate: str | None = None, engine: dict | None = None,
             **config) -> LiveServer:
        engine = tiny_engine(tiny_model_dir, speculate=speculate or "off", **(engine or {}))
        server = LiveServer(engine, ServerConfig(model_name="tiny", **config), send_buffer)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
