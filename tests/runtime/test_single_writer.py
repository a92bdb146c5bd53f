"""One writer per piece of request state (docs/ARCHITECTURE.md, nano-vllm's rule), enforced by
an `ast` walk like the layering test: only the scheduler moves a request between its queues and
touches its blocks and computed count; only the speculator sets its draft budget; only the
engine's `finish` ends it (the commit may say why: a stop, the length); a chunk split by layers
keeps its hidden states where the forward plan runs it."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("runtime", "speculative", "server", "prescient", "latency_bench")

# Request field -> the files that may assign it
OWNERS = {
    "status": {"runtime/scheduler.py"},
    "block_ids": {"runtime/scheduler.py"},
    "block_hashes": {"runtime/scheduler.py"},
    "num_computed_tokens": {"runtime/scheduler.py"},
    "num_cached_tokens": {"runtime/scheduler.py"},
    "num_preemptions": {"runtime/scheduler.py"},
    "num_overtaken": {"runtime/scheduler.py"},
    "chunk_tokens": {"runtime/scheduler.py"},
    "chunk_layer": {"runtime/scheduler.py"},
    "chunk_state": {"runtime/scheduler.py", "runtime/forward_plan.py"},
    "spec_budget": {"speculative/speculator.py"},
    "forced_budget": {"speculative/speculator.py"},
    "finish_reason": {"runtime/engine.py", "runtime/step_result.py"},
    "stop_reason": {"runtime/step_result.py"},
}
# Request-only names (a few are also fields of other classes, written through `self` there)
QUEUES = {"waiting", "running"}
MUTATORS = {"append", "appendleft", "extend", "insert", "remove", "pop", "popleft", "clear"}
# receivers that are not Requests although they carry a field of that name: server-side
# response objects (`status`), benchmark traces; their own classes' `self`
OTHER_RECEIVERS = {"self", "trace", "msg", "item", "r", "err"}
# not a Request's state: the draft model's own per-request KV table (speculative/draft_model.py)
NOT_REQUESTS = {("speculative/draft_model.py", "kv.block_ids")}


def _targets(node):
    if isinstance(node, ast.Assign):
        for t in node.targets:
            yield from _flatten(t)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        yield from _flatten(node.target)


def _flatten(t):
    if isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _flatten(e)
    else:
        yield t


def _receiver(node: ast.Attribute) -> str:
    v = node.value
    return v.id if isinstance(v, ast.Name) else ast.unparse(v)


def writes(path: pathlib.Path):
    """(line, field or queue, receiver) for each assignment to an owned field and each mutating
    call on a scheduler queue or a request's block list in the file."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and t.attr in OWNERS:
                yield node.lineno, t.attr, _receiver(t)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in QUEUES | {"block_ids", "block_hashes"}:
                yield node.lineno, owner.attr, _receiver(owner)


def files():
    for folder in SCANNED:
        root = REPO / folder
        yield from (p for p in root.rglob("*.py"))


def test_only_the_owner_writes_request_state():
    bad = []
    for path in files():
        rel = str(path.relative_to(REPO))
        for line, name, receiver in writes(path):
            if name in QUEUES | {"block_ids", "block_hashes"} and name not in OWNERS:
                allowed = {"runtime/scheduler.py"}
            else:
                allowed = OWNERS[name]
            if rel in allowed or (rel, f"{receiver}.{name}") in NOT_REQUESTS:
                continue
            if receiver in OTHER_RECEIVERS and name in ("status", "finished_time", "num_cached_tokens"):
                continue  # another class's field of the same name
            if receiver == "self" and rel not in allowed:
                continue  # a class's own attribute (the scheduler's queues are `self.waiting` there)
            bad.append(f"{rel}:{line}: {receiver}.{name}")
    assert not bad, "request state written outside its owner:\n" + "\n".join(bad)


def test_the_walk_sees_a_write_outside_the_owner(tmp_path):
    """The check itself: an assignment and a queue mutation outside the scheduler are found."""
    f = tmp_path / "x.py"
    f.write_text("def place(engine, request):\n    request.num_computed_tokens = 3\n"
                 "    engine.scheduler.running.append(request)\n    request.block_ids.extend([1])\n"
                 "    a, request.status = 1, 2\n")
    found = {(name, receiver) for _, name, receiver in writes(f)}
    assert found == {("num_computed_tokens", "request"), ("running", "engine.scheduler"),
                     ("block_ids", "request"), ("status", "request")}


def test_one_finish_ends_every_request():
    """`Engine.finish` is the one place a request leaves the engine's table and releases its
    blocks: no other code pops `engine.requests` or calls the scheduler's finish."""
    bad = []
    for path in files():
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f = node.func
            text = ast.unparse(f.value)
            if f.attr == "pop" and text.endswith("requests") and rel != "runtime/engine.py":
                if text.endswith("engine.requests"):
                    bad.append(f"{rel}:{node.lineno}: {text}.pop")
            if f.attr == "finish" and text.endswith("scheduler") and rel != "runtime/engine.py":
                bad.append(f"{rel}:{node.lineno}: {text}.finish")
            if f.attr == "_release" and rel != "runtime/engine.py":
                bad.append(f"{rel}:{node.lineno}: _release")  # only finish releases
    engine = (REPO / "runtime/engine.py").read_text()
    assert engine.count("self._release(") == 1 and engine.count("self.requests.pop(") == 1
    assert not bad, "\n".join(bad)
