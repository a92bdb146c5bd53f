"""Turning one step's sampled tokens into request state and a `RequestOutput`.

A step can emit several tokens for one request (accepted drafts + the bonus/recovered token).
They are appended one at a time so stop tokens, `max_tokens` and `max_seq_len` (the context or
the whole KV cache, the smaller) cut the run exactly where plain decoding would have stopped;
stop strings are matched on the detokenized text, and text that could still become a stop
string is held back from the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prescient.runtime.request import Request, RequestOutput
from prescient.runtime.tokenizer import IncrementalDetokenizer


@dataclass
class SeqResult:
    tokens: list[int]  # emitted this step, in order (accepted drafts, then bonus/recovered)
    sources: list[str]  # per token: target / draft / forced
    num_accepted_draft: int  # draft tokens accepted (their KV is now valid)
    logits: torch.Tensor | None = None  # [len(tokens), vocab] logits each token was chosen from (logprobs)


def commit_tokens(request: Request, result: SeqResult, detok: IncrementalDetokenizer | None,
                  max_seq_len: int, now: float) -> RequestOutput:
    params = request.params
    emitted: list[int] = []
    for token in result.tokens:
        request.output_token_ids.append(token)
        emitted.append(token)
        if token in params.stop_token_ids or (token in request.eos_token_ids and not params.ignore_eos):
            request.finish_reason, request.stop_reason = "stop", token
            break
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= max_seq_len:
            request.finish_reason = "length"
            break
    if request.first_token_time is None:
        request.first_token_time = now
    request.token_times.extend([now] * len(emitted))
    sources = result.sources[:len(emitted)]
    request.token_sources.extend(sources)
    if request.grammar is not None and request.grammar.is_terminated() and request.finish_reason is None:
        request.finish_reason = "stop"

    new_text = ""
    if detok is not None:
        before = len(detok.text)
        detok.add(emitted)
        stop_at = _find_stop(detok.text, params.stop, max(0, before - _max_len(params.stop)))
        if stop_at is not None:
            detok.text = detok.text[:stop_at[0]]
            request.finish_reason, request.stop_reason = "stop", stop_at[1]
        finished = request.finish_reason is not None
        # Hold back a tail that may still grow into a stop string.
        hold = 0 if finished or not params.stop else _max_len(params.stop) - 1
        visible = max(len(detok.text) - hold, 0)
        sent = detok.sent
        new_text = detok.text[sent:visible] if visible > sent else ""
        detok.sent = max(sent, visible)
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=emitted,
        new_text=new_text,
        finished=request.finish_reason is not None,
        finish_reason=request.finish_reason,
        token_times=[now] * len(emitted),
        token_sources=sources,
        logprobs=_logprobs(result.logits, emitted, params.logprobs) if params.logprobs is not None else None,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=len(request.output_token_ids),
        slo_notes=list(request.slo_notes) if request.finish_reason is not None and request.slo_notes else None,
    )


def _max_len(stops: tuple[str, ...]) -> int:
    return max((len(s) for s in stops), default=0)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _logprobs(logits: torch.Tensor | None, tokens: list[int], top: int) -> list[dict] | None:
    if logits is None:
        return None
    logp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    out = []
    for row, token in zip(logp, tokens):
        entry = {"token_id": token, "logprob": float(row[token])}
        if top:
            vals, idx = row.topk(top)
            entry["top"] = [(int(i), float(v)) for v, i in zip(vals, idx)]
        out.append(entry)
    return out
