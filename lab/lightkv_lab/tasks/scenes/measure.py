"""What makes an instrument like a real LVLM, measured on a trained model.

`near_duplicates` is redundancy: the share of vision tokens whose most similar neighbour in
the same stage window has cosine >= 0.9 in the (centred) hidden states after a layer (the
first stage's layer is what merging sees). `region_relevance` is prompt dependence: per layer and
relevance policy, the share of the image's relevance mass ξ on the tokens the question asks
about (``meta["region"]`` of each episode), divided by their share of the image's area, so
1.0 is what a prompt-blind policy gives and larger means the policy finds what was asked.

Both work on any task whose episodes carry ``meta["region"]`` (bool ``[G, G]``; one vision
token per cell).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lightkv.adapters import apply
from lightkv.graph.layout import TokenKind
from lightkv.policies.relevance import Relevance
from lightkv.policies.schedulers import ExplicitSchedule
from lightkv.presets import get_preset
from lightkv_lab.tasks.registry import task_for

__all__ = ["near_duplicates", "region_relevance"]

POLICIES = ("query_softmax", "last_token", "text_attention")


@torch.no_grad()
def near_duplicates(
    model,
    episodes: Sequence,
    grid,
    layer: int,
    windows_per_side: int = 4,
    threshold: float = 0.9,
    batch: int = 32,
) -> dict:
    """Redundancy of the vision tokens in the hidden states after decoder layer ``layer``.

    For each vision token, the highest cosine similarity to another token of its window
    (``windows_per_side`` windows per image side, as the stage partitions them), after
    subtracting the image's mean vision token: the hidden states share a large common
    component (raw cosines are above 0.99 almost everywhere), which says nothing about
    what a merge mixes. Returns
    ``{"share": fraction of tokens with a neighbour >= threshold, "mean_best": mean of
    that best cosine, "tokens": how many tokens were measured, "shares": the share at
    thresholds 0.9, 0.95 and 0.99, "raw_shares": the same without centring}``.
    """
    data = task_for(grid).data
    g = grid.grid
    n_img = data.num_image_tokens(grid, model.config.vision_config.patch_size)
    if g % windows_per_side:
        raise ValueError(f"windows_per_side ({windows_per_side}) must divide the grid side ({g})")
    w = g // windows_per_side
    cells = torch.arange(g)
    window = (cells[:, None] // w) * windows_per_side + cells[None, :] // w  # [G, G]
    same = window.reshape(-1)[:, None] == window.reshape(-1)[None, :]
    same.fill_diagonal_(False)
    best_all: dict[str, list[torch.Tensor]] = {}
    for i in range(0, len(episodes), batch):
        inputs = data.collate_prompts(list(episodes[i : i + batch]), n_img)
        out = model(**inputs, output_hidden_states=True)
        hidden = out.hidden_states[layer + 1]
        vis = inputs["input_ids"] == data.IMAGE_ID
        tokens = hidden[vis].reshape(hidden.shape[0], n_img, -1).float()
        for key, x in (("centred", tokens - tokens.mean(1, keepdim=True)), ("raw", tokens)):
            unit = torch.nn.functional.normalize(x, dim=-1)
            cos = (unit @ unit.transpose(1, 2)).masked_fill(~same, -2.0)
            best_all.setdefault(key, []).append(cos.amax(-1).flatten())
    best = torch.cat(best_all["centred"])
    raw = torch.cat(best_all["raw"])
    return {
        "share": float((best >= threshold).float().mean()),
        "mean_best": float(best.mean()),
        "tokens": int(best.numel()),
        "layer": layer,
        "threshold": threshold,
        "shares": {str(t): float((best >= t).float().mean()) for t in (0.9, 0.95, 0.99)},
        "raw_shares": {str(t): float((raw >= t).float().mean()) for t in (0.9, 0.95, 0.99)},
    }


@torch.no_grad()
def region_relevance(
    model,
    episodes: Sequence,
    grid,
    layers: Sequence[int] | None = None,
    policies: Sequence[str] = POLICIES,
    batch: int = 32,
) -> dict:
    """Relevance on the asked region, as a multiple of its area share, per policy and layer.

    For each layer a one-stage pipeline after it (removing almost nothing) records the ξ
    that the policy computes from that layer's own projections. Episodes whose region is
    empty (a gem colour that is absent) are skipped. Returns ``{"episodes": n, "layers":
    {policy: {layer: {"ratio": mean mass / area share, "top_hit": share of episodes whose
    highest-ξ token is in the region}}}}``.
    """
    data = task_for(grid).data
    eps = [e for e in episodes if bool(e.meta["region"].any())]
    if not eps:
        raise ValueError("region_relevance needs episodes with a non-empty meta['region']")
    num_layers = model.config.text_config.num_hidden_layers
    layers = list(range(num_layers - 1)) if layers is None else list(layers)
    n_img = data.num_image_tokens(grid, model.config.vision_config.patch_size)
    out: dict = {"episodes": len(eps), "layers": {}}
    for policy in policies:
        per_layer = {}
        for layer in layers:
            pipe = replace(
                get_preset("lightkv"),
                relevance=Relevance.create(policy),
                scheduler=ExplicitSchedule(
                    layers=(layer,), removal_ratios=(0.01,), windows_per_side=(1,)
                ),
            )
            ratio_sum = hits = 0.0
            for i in range(0, len(eps), batch):
                chunk = eps[i : i + batch]
                with apply(pipe, model, record=True) as session:
                    model(**data.collate_prompts(chunk, n_img))
                rec = session.last_prefill.stages[0]
                xi = rec.relevance.float()
                vision = rec.layout.kind == int(TokenKind.VISION)
                for b, e in enumerate(chunk):
                    mass = xi[b][vision[b]]
                    mass = mass / mass.sum().clamp_min(1e-30)
                    region = e.meta["region"].reshape(-1)
                    ratio_sum += float(mass[region].sum()) / float(region.float().mean())
                    hits += float(region[int(mass.argmax())])
            per_layer[layer] = {"ratio": ratio_sum / len(eps), "top_hit": hits / len(eps)}
        out["layers"][policy] = per_layer
    return out
