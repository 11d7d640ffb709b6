"""How the trainer starts a stage: which parameters it trains (`trainable`), the decoder's
mimetic initialisation (`mimetic_init`: attention near scaled identities, optional lookup
heads) and the lookup heads' frozen query and key rows (`freeze_lookup`)."""

from __future__ import annotations

import torch

__all__ = ["freeze_lookup", "mimetic_init", "trainable"]


def mimetic_init(
    model,
    qk: float = 1.5,
    vo: float = 0.7,
    noise: float = 0.02,
    seed: int = 0,
    first: int = 0,
    translate: torch.Tensor | None = None,
    lookup_heads: int = 0,
    lookup_qk: float = 3.0,
    lookup_from: int = 0,
) -> None:
    """Query/key projections near ``qk * I`` (attention compares like with like) and value/
    output projections near ``vo * I`` (heads copy what they read), plus N(0, noise) noise,
    in layers ``first`` and later. Layers before ``first`` start as no-ops (zero attention
    output and MLP down projections): the prior for reading the image sits in the later
    layers, so the early ones learn only what the later ones cannot do."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, layer in enumerate(model.model.language_model.layers):
            attn = layer.self_attn
            if i < first:
                attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                continue
            for proj, scale in (
                (attn.q_proj, qk),
                (attn.k_proj, qk),
                (attn.v_proj, vo),
                (attn.o_proj, vo),
            ):
                w = proj.weight
                eye = torch.eye(w.shape[0], w.shape[1])
                w.copy_(scale * eye + noise * torch.randn(w.shape, generator=gen))
            if translate is not None and lookup_heads and i >= lookup_from:
                rows = slice(0, lookup_heads * attn.head_dim)
                attn.q_proj.weight[rows] = lookup_qk * translate[rows] + noise * torch.randn_like(
                    attn.q_proj.weight[rows]
                )
                out = attn.o_proj.weight
                out[:, rows] = vo * translate.T[:, rows] + noise * torch.randn_like(out[:, rows])


def freeze_lookup(model, first: int, heads: int) -> None:
    """Keep the query and key rows of the lookup heads (layers ``first`` on) at their
    initial values: their gradients are zeroed, so Adam never moves them (weight decay
    aside). The heads stay text-to-vision retrieval heads; what they bring back, and
    everything else, is learned."""
    for layer in list(model.model.language_model.layers)[first:]:
        attn = layer.self_attn
        rows = heads * attn.head_dim
        for proj in (attn.q_proj, attn.k_proj):

            def hook(grad, rows=rows):
                grad = grad.clone()
                grad[:rows] = 0
                return grad

            proj.weight.register_hook(hook)


def trainable(model, stage: str) -> list[torch.nn.Parameter]:
    for p in model.parameters():
        p.requires_grad_(False)
    if stage == "align":
        mods = [
            model.model.vision_tower,
            model.model.multi_modal_projector,
        ]  # qa and tune: the decoder
    else:
        mods = [model.model.language_model]
    params = [p for m in mods for p in m.parameters()]
    emb = model.get_input_embeddings().weight
    params = [p for p in params if p is not emb]
    for p in params:
        p.requires_grad_(True)
    return params
