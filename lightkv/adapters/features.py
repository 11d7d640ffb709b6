"""What a scheduled layer's stage reads besides the hidden states: prompt relevance ξ and,
for key-space scorers, the layer's keys, computed from the layer's own projections.

Internals of `lightkv.adapters.session` (it calls these from a decoder layer's forward
pre-hook); an adapter author does not need them. `relevance` projects only the query rows
and key columns the relevance policy declares it reads, never an ``N x N`` matrix.
"""

from __future__ import annotations

import torch

from ..graph.layout import VisionLayout
from ..graph.scatter import pack_rows
from ..policies.prompt import Prompt
from ..policies.relevance import Relevance
from .masks import _batch, _last_valid, gather_tokens
from .probes import AttentionProbe

__all__ = ["relevance", "stage_key_states"]


def relevance(
    probe: AttentionProbe,
    policy: Relevance,
    hidden: torch.Tensor | None,
    pos: tuple[torch.Tensor, torch.Tensor] | None,
    layout: VisionLayout,
    layer: int,
    raw: dict[str, torch.Tensor] | None = None,
    prompt: Prompt | None = None,
    tower: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """ξ ``[B, N]`` at a layer from the layer's input, projecting only the rows and
    columns the relevance policy reads.

    Args:
        probe: the layer's attention probe (norm, projections, rotary embedding).
        policy: the relevance policy (a stage's ``relevance``, or any other).
        hidden: the layer's input hidden states ``[B, N, D]`` (unused when ``raw`` is given).
        pos: the layer's ``(cos, sin)`` position embeddings.
        layout: the layout of ``hidden``.
        layer: the layer's index (for error messages).
        raw: the layer's own projection outputs for every row (`AttentionProbe.project`
            of the normed input, read during the layer's forward): rows are gathered from
            them instead of projected again.
        prompt: the prefill's token ids, given to a policy that `reads_prompt`.
        tower: ``[B, H, N]`` attention received inside the vision tower, given to a policy
            that `reads_tower`.

    Returns:
        ``(xi, flops)``: ξ (at least float32) and the FLOPs the projections and scores cost
        (no projection FLOPs when ``raw`` is given).
    """
    rel = policy
    rows, cols = rel.query_rows, rel.key_cols
    # the policy gets what it declares it reads (`Relevance.reads_prompt`, ...), nothing else
    extra = {k: v for k, v in (("prompt", prompt), ("tower", tower)) if getattr(rel, f"reads_{k}")}
    if rel.reads_hidden:
        if hidden is None:
            raise RuntimeError(
                f"layer {layer}: {type(rel).__name__} reads the hidden states, which were not given"
            )
        extra["hidden"] = hidden
    if rows == "none" and cols == "none":
        flops = 0.0
        if rel.reads_hidden and hidden is not None:  # given whenever it is read (checked above)
            flops = rel.hidden_flops(layout, hidden.shape[-1], prompt)
        return rel.score(None, None, layout, **extra).float(), flops
    b, n = layout.batch_size, layout.seq_len
    if pos is None:
        raise RuntimeError(
            f"layer {layer} received no position_embeddings; cannot compute relevance"
        )
    cos, sin = _batch(pos[0], b), _batch(pos[1], b)
    x: torch.Tensor | None = None
    if raw is None:
        assert hidden is not None, "the hidden states are projected when no raw outputs are given"
        x = probe.normed(hidden)
    d = probe.head_dim
    flops = 0.0

    def project(what: str, index: torch.Tensor, heads: int, packed: bool = False) -> torch.Tensor:
        nonlocal flops
        finish = probe.queries_from if what == "queries" else probe.keys_from
        every = index.shape[1] == n  # every row, in order: nothing to gather or scatter back
        if raw is None:
            assert x is not None  # normed above when raw is None
            part = probe.project_only(x if every else gather_tokens(x, index), what)
            flops += 2.0 * index.numel() * probe.hidden * heads * d
        else:
            part = raw if every else {k: gather_tokens(v, index) for k, v in raw.items()}
        if every:
            return finish(part, cos, sin)
        out = finish(part, gather_tokens(cos, index), gather_tokens(sin, index))
        if packed:  # the policy reads these rows as they are (`Relevance.packed_text_keys`)
            return out
        full = out.new_zeros(b, heads, n, out.shape[-1])
        # in place: an out-of-place scatter would copy the [B, H, N, d] zeros once more (48 MB at 7B
        # width)
        return full.scatter_(2, index[:, None, :, None].expand(-1, heads, -1, out.shape[-1]), out)

    all_rows = torch.arange(n, device=cos.device).expand(b, n)
    if rows == "all":
        queries = project("queries", all_rows, probe.heads)
    elif rows == "last":
        queries = project("queries", _last_valid(layout.valid_mask).unsqueeze(1), probe.heads)
    else:
        queries = None
    if cols == "all":
        keys = project("keys", all_rows, probe.kv_heads)
    elif cols == "text":
        text_pos, _ = pack_rows(layout.text_mask)
        keys = project(
            "keys", text_pos, probe.kv_heads, packed=rel.packed_text_keys and text_pos.shape[1] < n
        )
    else:
        keys = None
    q_rows = n if rows == "all" else (1 if rows == "last" else 0)
    k_cols = n if cols == "all" else (int(layout.text_mask.sum(1).max()) if cols == "text" else 0)
    own = rel.product_flops(layout, probe.heads, d)  # e.g. only the causal half
    flops += own if own is not None else 2.0 * b * probe.heads * d * q_rows * k_cols
    xi = rel.score(queries, keys, layout, **extra)
    return xi.to(torch.promote_types(xi.dtype, torch.float32)), flops


def stage_key_states(
    probe: AttentionProbe, hidden: torch.Tensor | None, raw: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, float]:
    """The layer's keys of every token, pre-RoPE, per head: ``[B, N, H_kv, d]`` (what
    `lightkv.policies.StageInputs.key_states` holds for policies that need
    ``"key_states"``), from the
    layer's raw projection outputs when given, else projected from ``hidden``; with the
    FLOPs of that projection (none when ``raw`` is given)."""
    if raw is not None:
        return probe.keys_from(raw, None, None).transpose(1, 2), 0.0
    assert hidden is not None, "the keys are projected from the hidden states without raw outputs"
    k = probe.keys(probe.normed(hidden), None, None)  # [B, H_kv, N, d], pre-RoPE
    return k.transpose(1, 2), 2.0 * hidden.shape[0] * hidden.shape[
        1
    ] * probe.hidden * probe.kv_heads * probe.head_dim
