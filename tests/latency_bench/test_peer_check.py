"""The llama.cpp peer is looked for where its server will run: `check_llamacpp_server` asks a
child with `--peer-pythonpath` first on its path (a build installed apart counts; a missing server
extra is named), and `llamacpp_version` reads the version installed there."""

from __future__ import annotations

import pytest

from prescient.latency_bench.bench_servers import PeerMissing, check_llamacpp_server, llamacpp_version


def _fake_llama_cpp(root, server_error: str | None = None, version: str = "9.8.7"):
    pkg = root / "llama_cpp"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "server" / "__init__.py").write_text(f"raise ImportError({server_error!r})\n" if server_error else "")
    (pkg / "server" / "app.py").write_text("")
    info = root / f"llama_cpp_python-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n")
    return str(root)


def test_a_peer_installed_apart_is_found_through_its_pythonpath(tmp_path):
    path = _fake_llama_cpp(tmp_path)
    check_llamacpp_server(path)  # no PeerMissing: the child imports the folder's llama_cpp
    assert llamacpp_version(path) == "9.8.7"


def test_a_peer_without_its_server_extra_is_refused_naming_what_is_missing(tmp_path):
    path = _fake_llama_cpp(tmp_path, server_error="No module named 'fastapi'")
    with pytest.raises(PeerMissing, match=r"--peer-pythonpath .*No module named 'fastapi'"):
        check_llamacpp_server(path)


def test_a_server_that_dies_says_how_rather_than_connection_error():
    """A peer killed by SIGILL mid-request (a build for another CPU) is named with the signal and
    its last output lines; a running one has no exit reason; a plain exit gives its status."""
    import signal
    import sys

    from prescient.latency_bench.bench_servers import _Process

    code = "import os, signal, sys; print('loading'); sys.stdout.flush(); os.kill(os.getpid(), signal.SIGILL)"
    dying = _Process([sys.executable, "-c", code])
    dying.name = "fake peer"
    assert dying.proc.wait(30) == -signal.SIGILL
    reason = dying.exit_reason()
    assert reason.startswith("fake peer was killed by SIGILL (an instruction this machine refused")
    assert reason.endswith("\nloading")

    running = _Process([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert running.exit_reason() is None
    finally:
        running.stop()
    exiting = _Process([sys.executable, "-c", "raise SystemExit(3)"])
    exiting.proc.wait(30)
    assert exiting.exit_reason().startswith("server exited with status 3")
