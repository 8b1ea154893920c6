"""Tree verification: a draft proposed a tree of candidate tokens; walk it from the root,
accepting at each node at most one child, so the emitted tokens are distributed exactly as the
target's samples (random modes) or are the target's argmax path (greedy).

The tree, per request, N nodes in an order where every child comes after its parent (node 0 is
the root: the last token already emitted): `tokens[b, i]` the candidate token of node i (node
0's is ignored), `first_child[b, i]` and `next_sibling[b, i]` (-1: none). `target_probs[b, i]`
is the target's distribution of the token after node i (V entries), so it scores node i's
children; in the `draft` mode `draft_probs[b, i]` is the distribution node i's children were
drawn from (i.i.d.).

Random verification (SpecInfer's multi-draft rejection sampling). At node c with target
distribution p, the residual starts as s = p. Each child x (token t_x) in sibling order is
accepted with probability s(t_x) / (Z q(t_x)), Z = sum s, i.e. when u_x Z q(t_x) < s(t_x); on
acceptance the walk moves to x. On rejection the residual becomes s <- max(0, s - Z q). With
every child drawn from the same q, the residual after n rejections has the closed form
s_n = max(0, p - c_n q), c_0 = 0, c_{n+1} = c_n + Z_n, so the kernel keeps one scalar, not a
vector. When no child is accepted (or the node is a leaf), the final token is drawn from s by
inverse CDF with the request's final uniform: it is then distributed exactly as p.
- `draft` mode: q = draft_probs[b, c].
- `target_only` mode: the draft tokens are taken as given (q = one-hot on each child's token),
  so a child is accepted with probability s(t_x)/Z, and a rejection zeroes t_x in the residual:
  s = p less the tokens already rejected at this node.
Greedy verification: the child whose token is the argmax of p (the first such sibling) is
accepted; otherwise the argmax itself is the final token. No draws.

The draws (`uniforms`, (B, N) fp32 in [0, 1), or made in the kernel from a seed: u[b, x] =
Philox(seed, offset + b N + x), `draws.py`): u[b, x] decides node x (x >= 1; each node is
tried at most once), u[b, 0] draws the final token. A residual with no mass left (rounding;
reached only through a rejection that had probability 0) falls back to p; a threshold rounding
at or above the sum takes the last token with mass.

Outputs: `out_ids` (B, N) int32, the accepted tokens in order, then the final token, then -1;
`out_nodes` (B, N) int32, the accepted nodes (so a caller keeps their KV entries), then -1;
`emitted` (B,) int32, the number of accepted drafts. Work: every node on the walk reads one row
of p (and in `draft` mode one row of q) once to sum it, plus once per rejected child in `draft`
mode (Z changes); the final draw reads its row once more. Bytes and latency, no FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kforge.kernels.speculative.chain import PROB_DTYPES
from kforge.kernels.speculative.draws import check_seed, draw, seed_in_memory

MODES = {"greedy": 0, "target_only": 1, "draft": 2}
BLOCK_V = 1024


@triton.jit
def _row_sum(p_row, q_row, c, V, Q_MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    """sum_v max(0, p - c q) over a vocabulary row (Q_MODE 0: sum p)."""
    offs_v = tl.arange(0, BLOCK_V)
    total = 0.0
    for v0 in range(0, V, BLOCK_V):
        live = v0 + offs_v < V
        p = tl.load(p_row + v0 + offs_v, mask=live, other=0.0).to(tl.float32)
        if Q_MODE:
            q = tl.load(q_row + v0 + offs_v, mask=live, other=0.0).to(tl.float32)
            p = tl.maximum(p - c * q, 0.0)
        total += tl.sum(p, 0)
    return total


@triton.jit
def _row_argmax(p_row, V, BLOCK_V: tl.constexpr):
    """The first index of a vocabulary row's largest value (the reference's tie rule)."""
    offs_v = tl.arange(0, BLOCK_V)
    top = -1.0
    best = 0
    for v0 in range(0, V, BLOCK_V):
        p = tl.load(p_row + v0 + offs_v, mask=v0 + offs_v < V, other=-1.0).to(tl.float32)
        block_top = tl.max(p, 0)
        block_arg = tl.min(tl.where(p == block_top, v0 + offs_v, V), 0)
        best = tl.where(block_top > top, block_arg, best)
        top = tl.maximum(top, block_top)
    return best


@triton.jit
def tree_verify_kernel(tokens_ptr, first_child_ptr, next_sibling_ptr, target_ptr, draft_ptr, uniforms_ptr,
                       out_ids_ptr, out_nodes_ptr, emitted_ptr,
                       stride_nb, stride_tb, stride_tn, stride_db, stride_dn, stride_ub, stride_ob,
                       N, V, seed, offset, seed_ptr, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_V: tl.constexpr, SEEDED: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    u_row = uniforms_ptr + b * stride_ub
    if SEED_IN_MEMORY:  # a seed tensor: (seed, offset) read as the kernel runs (a CUDA graph replays them)
        seed = tl.load(seed_ptr)
        offset = tl.load(seed_ptr + 1)
    first = offset + b * N  # this request's first Philox counter (SEEDED)
    offs_v = tl.arange(0, BLOCK_V)
    offs_n = tl.arange(0, BLOCK_N)
    tree = b * stride_nb
    rejected = tl.full([BLOCK_N], -1, tl.int32)  # target_only: this node's rejected tokens
    n_rejected = 0
    cur = 0
    emitted = 0
    child = tl.load(first_child_ptr + tree)
    c = 0.0  # draft: the residual is max(0, p - c q)
    p_row = target_ptr + b * stride_tb
    q_row = draft_ptr + b * stride_db
    z = 0.0  # the residual's mass at the current node (random modes)
    if MODE != 0:
        z = _row_sum(p_row, q_row, c, V, 0, BLOCK_V)
    best = 0
    if MODE == 0:  # greedy: the argmax of the root's row
        best = _row_argmax(p_row, V, BLOCK_V)
    while child >= 0:
        token = tl.load(tokens_ptr + tree + child)
        if MODE == 0:
            accept = token == best
        elif MODE == 1:
            seen = tl.sum(((rejected == token) & (offs_n < n_rejected)).to(tl.int32), 0) > 0
            s_tok = tl.where(seen, 0.0, tl.load(p_row + token).to(tl.float32))
            accept = draw(u_row, seed, first, child, True, SEEDED) * z < s_tok
        else:
            q_tok = tl.load(q_row + token).to(tl.float32)
            s_tok = tl.maximum(tl.load(p_row + token).to(tl.float32) - c * q_tok, 0.0)
            accept = draw(u_row, seed, first, child, True, SEEDED) * z * q_tok < s_tok
        if accept:
            tl.store(out_ids_ptr + b * stride_ob + emitted, token)
            tl.store(out_nodes_ptr + b * stride_ob + emitted, child)
            emitted += 1
            cur = child
            p_row = target_ptr + b * stride_tb + cur.to(tl.int64) * stride_tn
            q_row = draft_ptr + b * stride_db + cur.to(tl.int64) * stride_dn
            c = 0.0
            n_rejected = 0
            if MODE != 0:
                z = _row_sum(p_row, q_row, c, V, 0, BLOCK_V)
            else:
                best = _row_argmax(p_row, V, BLOCK_V)
            child = tl.load(first_child_ptr + tree + cur)
        else:
            if MODE == 1:
                if not seen:
                    rejected = tl.where(offs_n == n_rejected, token, rejected)
                    n_rejected += 1
                    z -= s_tok
            elif MODE == 2:
                c += z
                z = _row_sum(p_row, q_row, c, V, 1, BLOCK_V)
            child = tl.load(next_sibling_ptr + tree + child)

    # the final token: greedy, the argmax; else inverse CDF over the residual (p if it has no mass)
    if MODE == 0:
        token = best
    else:
        use_residual = z > 0.0
        keep = tl.where(use_residual, 1.0, 0.0)
        mass = tl.where(use_residual, z, _row_sum(p_row, q_row, 0.0, V, 0, BLOCK_V))
        threshold = draw(u_row, seed, first, 0, True, SEEDED) * mass
        running = 0.0
        token = V
        last_positive = -1
        for v0 in range(0, V, BLOCK_V):
            if token == V:  # blocks after the one holding the token are not read
                live = v0 + offs_v < V
                s = tl.load(p_row + v0 + offs_v, mask=live, other=0.0).to(tl.float32)
                if MODE == 1:  # the rejected tokens out, unless falling back to p (a few: one pass each)
                    for j in range(0, n_rejected):
                        rejected_token = tl.sum(tl.where(offs_n == j, rejected, 0), 0)
                        s = tl.where(v0 + offs_v == rejected_token, s * (1.0 - keep), s)
                else:
                    q = tl.load(q_row + v0 + offs_v, mask=live, other=0.0).to(tl.float32)
                    s = tl.maximum(s - keep * c * q, 0.0)
                positive = (s > 0.0) & live
                crossed = (running + tl.cumsum(s, 0) > threshold) & positive
                token = tl.minimum(token, tl.min(tl.where(crossed, v0 + offs_v, V), 0))
                last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, v0 + offs_v, -1), 0))
                running += tl.sum(s, 0)
        token = tl.where(token < V, token, tl.maximum(last_positive, 0))
    tl.store(out_ids_ptr + b * stride_ob + emitted, token)
    tl.store(out_nodes_ptr + b * stride_ob + emitted, -1)
    pad = emitted + 1 + offs_n
    tl.store(out_ids_ptr + b * stride_ob + pad, tl.full([BLOCK_N], -1, tl.int32), mask=pad < N)
    tl.store(out_nodes_ptr + b * stride_ob + pad, tl.full([BLOCK_N], -1, tl.int32), mask=pad < N)
    tl.store(emitted_ptr + b, emitted)


def check_tree_inputs(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                      target_probs: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None,
                      mode: str, seeded: bool = False) -> None:
    """Raise ValueError on shapes, dtypes, devices or strides the kernel cannot take (no device read)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if target_probs.dim() != 3 or target_probs.shape[1] == 0 or target_probs.shape[2] == 0:
        raise ValueError(f"target_probs must be (batch, nodes >= 1, vocab >= 1), got {tuple(target_probs.shape)}")
    batch, nodes, vocab = target_probs.shape
    for name, t in (("tokens", tokens), ("first_child", first_child), ("next_sibling", next_sibling)):
        if t.shape != (batch, nodes) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (batch, nodes) = {(batch, nodes)}, got {t.dtype} {tuple(t.shape)}")
    if target_probs.dtype not in PROB_DTYPES:
        raise ValueError(f"target_probs must be float32, float16 or bfloat16, got {target_probs.dtype}")
    tensors = {"tokens": tokens, "first_child": first_child, "next_sibling": next_sibling,
               "target_probs": target_probs}
    if mode == "draft":
        if draft_probs is None or draft_probs.shape != target_probs.shape or draft_probs.dtype not in PROB_DTYPES:
            raise ValueError(f"the draft mode needs draft_probs shaped as target_probs {(batch, nodes, vocab)}, got "
                             f"{None if draft_probs is None else tuple(draft_probs.shape)}")
        tensors["draft_probs"] = draft_probs
    if mode != "greedy" and not seeded:
        if uniforms is None or uniforms.shape != (batch, nodes) or uniforms.dtype != torch.float32:
            raise ValueError(f"the random modes need uniforms float32 (batch, nodes) = {(batch, nodes)} or a seed, got "
                             f"{None if uniforms is None else (uniforms.dtype, tuple(uniforms.shape))}")
        tensors["uniforms"] = uniforms
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"the inputs are on different devices: {sorted(map(str, devices))}")
    for name, t in tensors.items():
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2] * t.stride(2) and t.shape[1] > 1):
            raise ValueError(f"{name} needs contiguous rows, got strides {t.stride()}")
    if tokens.stride() != first_child.stride() or tokens.stride() != next_sibling.stride():
        raise ValueError("tokens, first_child and next_sibling must share one layout")


def check_tree_draws(uniforms: torch.Tensor | None, seed: int | torch.Tensor | None, offset: int, mode: str) -> bool:
    """Raise ValueError on uniforms and a seed together, or a bad seed; return whether the kernel
    makes its own draws (a seed, in a random mode)."""
    if seed is not None:
        if uniforms is not None:
            raise ValueError("give the draws as uniforms or as a seed (and offset), not both")
        check_seed(seed, offset)
    return seed is not None and mode != "greedy"


def check_tree_values(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                      vocab: int) -> None:
    """Raise ValueError unless each link points forward (-1 or a later node: the walk ends) and
    each non-root token is in the vocabulary. One device read."""
    nodes = tokens.shape[1]
    index = torch.arange(nodes, device=tokens.device)
    for name, links in (("first_child", first_child), ("next_sibling", next_sibling)):
        bad = (links != -1) & ((links <= index) | (links >= nodes))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}[{b}, {i}] = {int(links[b, i])}: a link must be -1 or a later node (< {nodes})")
    drafted = tokens[:, 1:]
    if drafted.numel() and bool(((drafted < 0) | (drafted >= vocab)).any()):
        raise ValueError(f"tokens must lie in [0, {vocab}) for every node but the root")


def tree_verify(tokens: torch.Tensor, first_child: torch.Tensor, next_sibling: torch.Tensor,
                target_probs: torch.Tensor, uniforms: torch.Tensor | None = None, *,
                draft_probs: torch.Tensor | None = None, mode: str = "target_only",
                seed: int | torch.Tensor | None = None, offset: int = 0, validate: bool = True,
                block_v: int = BLOCK_V) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel: (out_ids (B, N), out_nodes (B, N), emitted (B,)), all int32 (module docstring).
    `mode`: greedy (no draws), target_only, or draft (with draft_probs). The random modes' draws:
    `uniforms` (B, N), or `seed` (and `offset`): u[b, x] = Philox(seed, offset + b N + x) made in
    the kernel, as integers or a seed tensor on the inputs' device (`draws.py`). `validate`
    reads the tree back once to refuse backward links and tokens outside the vocabulary."""
    seeded = check_tree_draws(uniforms, seed, offset, mode)
    check_tree_inputs(tokens, first_child, next_sibling, target_probs, draft_probs, uniforms, mode, seeded)
    batch, nodes, vocab = target_probs.shape
    if validate:
        check_tree_values(tokens, first_child, next_sibling, vocab)
    device = target_probs.device
    out_ids = torch.empty((batch, nodes), dtype=torch.int32, device=device)
    out_nodes = torch.empty((batch, nodes), dtype=torch.int32, device=device)
    emitted = torch.empty(batch, dtype=torch.int32, device=device)
    if batch == 0:
        return out_ids, out_nodes, emitted
    draft = draft_probs if draft_probs is not None else target_probs  # not read outside the draft mode
    draws = uniforms if uniforms is not None else out_ids  # not read in the greedy mode, nor when seeded
    in_memory = seeded and seed_in_memory(seed, device)
    tree_verify_kernel[(batch,)](
        tokens, first_child, next_sibling, target_probs, draft, draws, out_ids, out_nodes, emitted,
        tokens.stride(0), target_probs.stride(0), target_probs.stride(1), draft.stride(0), draft.stride(1),
        draws.stride(0), out_ids.stride(0), nodes, vocab, 0 if in_memory or not seeded else seed, offset,
        seed if in_memory else out_ids, MODE=MODES[mode], BLOCK_N=max(2, triton.next_power_of_2(nodes)),
        BLOCK_V=min(block_v, max(16, triton.next_power_of_2(vocab))), SEEDED=seeded, SEED_IN_MEMORY=in_memory,
        num_warps=4)
    return out_ids, out_nodes, emitted


def tree_verify_reference(tokens, first_child, next_sibling, target_probs, uniforms=None, *, draft_probs=None,
                          mode: str = "target_only") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule of the module docstring in float64, one request at a time, with the residual kept
    as a vector (the kernel's closed form is not used here)."""
    batch, nodes, vocab = target_probs.shape
    out_ids = torch.full((batch, nodes), -1, dtype=torch.int32)
    out_nodes = torch.full((batch, nodes), -1, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        cur, n = 0, 0
        while True:
            p = target_probs[b, cur].double().cpu()
            residual = p.clone()
            child = int(first_child[b, cur])
            moved = False
            while child >= 0:
                token = int(tokens[b, child])
                if mode == "greedy":
                    accept = token == _argmax(p)
                elif mode == "target_only":
                    accept = float(uniforms[b, child]) * float(residual.sum()) < float(residual[token])
                else:
                    q = draft_probs[b, cur].double().cpu()
                    accept = float(uniforms[b, child]) * float(residual.sum()) * float(q[token]) < float(residual[token])
                if accept:
                    out_ids[b, n], out_nodes[b, n] = token, child
                    n, cur, moved = n + 1, child, True
                    break
                if mode == "target_only":
                    residual[token] = 0.0
                elif mode == "draft":
                    residual = (residual - residual.sum() * q).clamp(min=0)
                child = int(next_sibling[b, child])
            if moved:
                continue
            if mode == "greedy":
                final = _argmax(p)
            else:
                dist = residual if residual.sum() > 0 else p
                threshold = float(uniforms[b, 0]) * float(dist.sum())
                positive = dist > 0
                hit = (dist.cumsum(0) > threshold) & positive
                final = int(hit.long().argmax()) if hit.any() else (
                    int(positive.nonzero().max()) if positive.any() else 0)
            out_ids[b, n] = final
            emitted[b] = n
            break
    return out_ids, out_nodes, emitted


def _argmax(p: torch.Tensor) -> int:
    """The first index of the largest value (the kernel's tie rule)."""
    return int((p == p.max()).nonzero()[0])
