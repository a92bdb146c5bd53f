"""OpenAI presence / frequency penalties and logit_bias on the logits of this step's sampling rows.

    logit[t] += logit_bias[t]
    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)

where count[t] is how often token t occurs in the request's output so far (OpenAI's definition:
generated tokens, not the prompt). With speculation each row of a draft tree predicts the token
after its node, so its counts also include the draft tokens on the path from the root to that
node: the penalised distribution at every node is exactly the one plain decoding would use after
the same tokens, and verification stays lossless.

The bias is the same in every row (it depends on no context), so a draft tree's rows get it too
and verification samples from the biased distribution plain decoding would. A bias of -100 (or
less than the gap to the best token) bans a token in practice, as OpenAI says; the grammar mask,
applied after, still has the last word: a biased token the grammar forbids stays forbidden.

Penalties apply before the grammar mask and before temperature / top-k / top-p, as in OpenAI's
and vLLM's samplers. Requests without penalties or bias cost nothing here. On the device path
(`upload` given: runtime/step_path.DeviceStepPath.upload) a request's ids, bias values and path
tokens go up in one non-blocking copy and the counts are built on the device by scatter-adds,
the same values as the host's bincount, with no blocking copy.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_penalties(
    logits: torch.Tensor,  # [num_logits, vocab], sampling rows in batch order, modified in place
    seqs,  # the step's ScheduledSeqs
    trees,  # DraftTree | None per seq (None = one row for a sampling seq)
) -> None:
    row = 0
    for seq, tree in zip(seqs, trees):
        if not seq.samples:
            continue
        num_rows = tree.num_nodes if tree is not None else 1
        penalize_rows(logits[row:row + num_rows], seq.request, tree)
        row += num_rows


def penalize_rows(
    rows: torch.Tensor,  # [num_rows, vocab]: one request's sampling rows (a tree's nodes, or one), in place
    request,
    tree,  # DraftTree | None
    upload=None,  # the device path's (list of int sequences) -> int64 device tensors, one copy
) -> None:
    """One request's part of `apply_penalties` (the engine calls it per request, so a failure
    here is that request's alone)."""
    params = request.params
    if upload is not None:
        if params.logit_bias or params.frequency_penalty or params.presence_penalty:
            _penalize_on_device(rows, request, tree, upload)
        return
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=rows.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=rows.dtype, device=rows.device)
        rows[:, ids] += bias
    if params.frequency_penalty or params.presence_penalty:
        counts = _path_counts(request.output_token_ids, tree, rows.shape[1], rows.device)
        penalty = counts.to(rows.dtype) * params.frequency_penalty
        penalty += (counts > 0).to(rows.dtype) * params.presence_penalty
        rows.sub_(penalty)


def _path_counts(
    output_ids: list[int],
    tree,  # DraftTree | None
    vocab: int,
    device: torch.device,
) -> torch.Tensor:  # [num_rows, vocab] int64
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab)[:vocab]
    if tree is None or tree.num_nodes == 1:
        return base.to(device)[None]
    # Node i's context adds the draft tokens of its ancestors and itself (the root is the last
    # committed token, already in output_ids or the prompt).
    ancestors = tree.ancestor_mask.clone()  # [num_nodes, num_nodes] bool
    ancestors[:, 0] = False
    tokens = torch.tensor(tree.tokens, dtype=torch.int64)
    extra = torch.zeros(tree.num_nodes, vocab, dtype=torch.int64)
    node_rows, node_cols = ancestors.nonzero(as_tuple=True)
    extra.index_put_((node_rows, tokens[node_cols]), torch.ones_like(node_rows), accumulate=True)
    return (base[None] + extra).to(device)


def _penalize_on_device(rows: torch.Tensor, request, tree, upload) -> None:
    """penalize_rows with one upload: bias ids and values (float64 bits in int64), the output
    ids, and per draft node the tokens of its path (row, token) pairs."""
    params = request.params
    num_rows, vocab = rows.shape
    bias_ids = [t for t, _ in params.logit_bias]
    bias_bits = np.array([b for _, b in params.logit_bias], dtype=np.float64).view(np.int64)
    penalised = bool(params.frequency_penalty or params.presence_penalty)
    node_rows, node_tokens = [], []
    if penalised and tree is not None and tree.num_nodes > 1:
        for i in range(tree.num_nodes):  # node i's context adds its ancestors' and its own draft tokens
            j = i
            while j > 0:
                node_rows.append(i)
                node_tokens.append(tree.tokens[j])
                j = tree.parents[j]
    ids_t, bits_t, out_t, nrow_t, ntok_t = upload(
        [bias_ids, bias_bits, request.output_token_ids if penalised else [], node_rows, node_tokens])
    if bias_ids:
        rows[:, ids_t] += bits_t.view(torch.float64).to(rows.dtype)
    if penalised:
        base = torch.zeros(vocab, dtype=torch.int64, device=rows.device)
        base.scatter_add_(0, out_t, torch.ones_like(out_t))
        counts = base[None].repeat(num_rows, 1)  # [num_rows, vocab]
        if len(node_rows):
            counts.index_put_((nrow_t, ntok_t), torch.ones_like(nrow_t), accumulate=True)
        penalty = counts.to(rows.dtype) * params.frequency_penalty
        penalty += (counts > 0).to(rows.dtype) * params.presence_penalty
        rows.sub_(penalty)
