"""Servers the agent benchmark drives, each its own process: `prescient serve` and the peer.

`PrescientServer` runs `python -m prescient.cli serve --port 0 --calibrate fresh ...`
(`prescient_command`: calibrated at start-up, before any peer runs) and reads its URL from the
banner; `LlamaCppServer` runs llama-cpp-python's OpenAI-compatible server (`python -m
llama_cpp.server`, the `peers` extra; its web stack comes from llama-cpp-python's `server`
extra) on the same GGUF and polls `/v1/models` until it answers. Either raises `PeerMissing`
with the reason (the report lists the system as not run). `cpu_seconds()` is user + system time
of the server process and all its descendants (grammar compile workers included), from /proc:
the figure a per-task cost is made of. `model_tokenizer` is the tokenizer the servers load for a
model, for clients that size prompts in tokens (the load benchmark's long prompt).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


class PeerMissing(Exception):
    """A system that cannot be started here; the message says why."""


def _tree_cpu_s(root: int) -> float:
    """utime + stime of `root` and its live descendants, plus what its reaped children used."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), fields)  # ppid, fields from state on
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid not in stats:
            continue
        fields = stats[pid][1]
        # fields[11..14] = utime, stime, cutime, cstime (stat fields 14..17)
        total += sum(int(x) for x in fields[11:15]) / tick
        todo += [p for p, (ppid, _) in stats.items() if ppid == pid]
    return total


class _Process:
    name = "server"

    def __init__(self, args: list[str], env: dict | None = None):
        self.args = args
        self.lines: list[str] = []
        self.url: str | None = None
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env)
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.on_line(line)
        self._ready.set()

    def on_line(self, line: str) -> None:
        pass

    def cpu_seconds(self) -> float:
        return _tree_cpu_s(self.proc.pid)

    def spec_counters(self) -> dict[str, float] | None:
        """The server's speculation counters so far (spec_counters_at); None for a server without
        them (a peer)."""
        return None

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.lines[-n:])

    def exit_reason(self) -> str | None:
        """None while the process runs; else how it ended and its last lines, for an error that
        says more than the client's "connection error" (a peer built for another CPU dies of
        SIGILL mid-request: llama-cpp-python 0.3.36 built with GGML_NATIVE on a 2-core Xeon with
        AMX did, in its AMX path, once a prompt was long enough to take it)."""
        rc = self.proc.poll()
        if rc is None:
            return None
        if rc < 0:
            try:
                how = f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"was killed by signal {-rc}"
            if -rc == signal.SIGILL:
                how += " (an instruction this machine refused: a build for another CPU, or a feature the OS did not enable)"
        else:
            how = f"exited with status {rc}"
        self._ready.wait(5)  # the pump has read its last lines
        return f"{self.name} {how}" + (f":\n{self.tail()}" if self.lines else "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)


def prescient_command(model: str | None, speculate: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The `prescient serve` command of a benchmark run beside other systems. It measures its
    verify-cost table fresh, at start-up (`--calibrate fresh`, before any peer is started): the
    default idle-time calibration would time its forwards while another system is measured (on two
    cores such a table came out up to 2x off, and n-gram then ran below plain decoding) and slow
    that system, and a cached table may come from such a run. `extra` comes after, so it may
    override."""
    args = [sys.executable, "-m", "prescient.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            "--speculate", speculate, "--quiet", "--calibrate", "fresh", *extra]
    if model:
        args += ["--model", model]
    return args


# What a phase's draft work was: the counters `prescient serve` exports on /metrics (server/metrics.py)
SPEC_COUNTERS = ("draft_tokens", "accepted_tokens", "forced_tokens_proposed", "forced_tokens_accepted")


def spec_counters_from_text(text: str) -> dict[str, float] | None:
    """SPEC_COUNTERS from a Prometheus text exposition; None when the server exports none (no
    speculator)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("prescient_spec_")
        if family.name.startswith("prescient_spec_") and name in SPEC_COUNTERS:
            found[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return {k: found.get(k, 0.0) for k in SPEC_COUNTERS} if found else None


def spec_counters_at(url: str) -> dict[str, float] | None:
    """The speculation counters of the prescient server at `url`; None when it exports none or
    /metrics does not answer (the report then says so rather than guessing)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return spec_counters_from_text(resp.read().decode())
    except OSError:
        return None


class PrescientServer(_Process):
    def __init__(self, model: str | None, speculate: str, extra: tuple[str, ...] = (), timeout_s: float = 300.0,
                 env: dict[str, str] | None = None):
        self.name = f"prescient serve --speculate {speculate}"
        super().__init__(prescient_command(model, speculate, extra), None if env is None else {**os.environ, **env})
        if not self._ready.wait(timeout_s) or self.url is None:
            self.stop()
            raise PeerMissing(f"{self.name} did not start:\n{self.tail()}")

    def spec_counters(self) -> dict[str, float] | None:
        return spec_counters_at(self.url)

    def on_line(self, line: str) -> None:
        m = re.search(r"OpenAI API\s+(http://\S+)/v1", line)
        if m:
            self.url = m.group(1)
        if "/metrics" in line:  # the banner's last line
            self._ready.set()


def model_tokenizer(model: str | None):
    """The tokenizer of `model` (None: the default GGUF) as `prescient serve` loads it: from the
    converted-weights cache that a server's start has filled, so well under a second then."""
    from prescient.build import EngineSpec
    from prescient.runtime.weights_cache import load_model_files

    spec = EngineSpec()
    return load_model_files(model, spec.dtype, weights=spec.weights).tokenizer


def llamacpp_version(pythonpath: str | None = None) -> str | None:
    """llama-cpp-python's version: from this environment, or from `pythonpath` (a folder it was
    installed into apart, e.g. a build for one ISA tier) when given."""
    import importlib.metadata

    try:
        if pythonpath:
            paths = pythonpath.split(os.pathsep)
            dist = next(iter(importlib.metadata.distributions(name="llama_cpp_python", path=paths)), None)
            if dist is not None:
                return dist.version
        return importlib.metadata.version("llama_cpp_python")
    except Exception:
        return None


def check_llamacpp_server(pythonpath: str | None = None) -> None:
    """Raise PeerMissing unless `python -m llama_cpp.server` can start here: llama-cpp-python and
    its server extra importable from this interpreter with `pythonpath` first on the path. Asked
    of a child with the server's own environment, so a peer installed apart (`--peer-pythonpath`)
    counts, which an import in this process would not see."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp, llama_cpp.server.app"], env=env,
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerMissing("llama-cpp-python's server is not importable (the `peers` extra"
                          + (f", or --peer-pythonpath {pythonpath}" if pythonpath else "") + f"): {why}")


class LlamaCppServer(_Process):
    """llama_cpp.server as its documentation sets it up for tool calls: a function-calling chat
    format (`chatml-function-calling`, for ChatML models such as SmolLM2) and the prompt cache on;
    requests queue rather than interrupt each other."""

    def __init__(self, model: str, threads: int, chat_format: str = "chatml-function-calling", n_ctx: int = 4096,
                 timeout_s: float = 180.0, pythonpath: str | None = None):
        check_llamacpp_server(pythonpath)
        if not model.endswith(".gguf"):
            raise PeerMissing(f"llama.cpp needs a .gguf model, got {model}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ)
        if pythonpath:  # the server extra's web stack, installed apart from this environment
            env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.name = f"llama_cpp.server {llamacpp_version(pythonpath)} ({chat_format}, cache on)"
        self.chat_format = chat_format
        super().__init__([sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
                          "--port", str(port), "--chat_format", chat_format, "--cache", "true", "--n_ctx", str(n_ctx),
                          "--n_threads", str(threads), "--verbose", "false",
                          # its default lets each new request cut off the one streaming: concurrent
                          # agents would get empty replies instead of waiting their turn
                          "--interrupt_requests", "false"], env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not self._answers(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                died = self.exit_reason()  # before stop(), which would make it SIGTERM
                self.stop()
                raise PeerMissing(died or f"{self.name} did not answer:\n{self.tail()}")
            time.sleep(0.3)

    @staticmethod
    def _answers(port: int) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

