"""`TowerTap`: the attention each image token receives inside the vision tower, for relevance
policies that declare ``reads_tower`` (VisionZip's dominant tokens,
`lightkv.methods.TowerAttention`) and for policies that name ``tower_layers`` (VScan's local
scan reads a shallow layer).

A forward pre-hook on the self-attention of the tower layer whose output the projector reads
(``vision_feature_layer``), or of a named layer, projects that layer's normed input once more
(one query row per image where the tower has a CLS token; every row, in chunks, where it has
none) and keeps ``[images, heads, tokens]``: never an ``N x N`` matrix. It runs on this model
instance only and is removed with the session's other hooks. Internals of
`lightkv.adapters.session`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..graph.layout import VisionLayout

__all__ = ["TowerSpec", "TowerTap"]

CHUNK = 256
"""Query rows per step of the mean over queries (towers without CLS)."""


@dataclass(frozen=True)
class TowerSpec:
    """Where an adapter's tower attention is read.

    Attributes:
        attention: the self-attention module of the tower layer whose output the projector
            reads (it has ``q_proj``, ``k_proj``, ``num_heads`` or ``num_attention_heads``,
            and ``scale`` or ``scaling``, else ``head_dim ** -0.5``).
        cls: the tower's first token is a CLS token (CLIP, DINOv2): its attention row is used
            and it is not an image token; otherwise (SigLIP) the attention received is averaged
            over every query.
    """

    attention: nn.Module
    cls: bool


class TowerTap:
    """Keeps the attention received per head and tower token of the last tower call.

    Args:
        spec: where to read it (the adapter's `tower_spec`).
        queries: ``cls`` (the CLS row; the tower must have a CLS token), ``mean`` (averaged
            over every query) or ``auto`` (``cls`` where the tower has one, else ``mean``).
    """

    def __init__(self, spec: TowerSpec, queries: str = "auto") -> None:
        for name in ("q_proj", "k_proj"):
            if not isinstance(getattr(spec.attention, name, None), nn.Module):
                raise TypeError(
                    f"{type(spec.attention).__name__} has no `{name}`: cannot read the tower's "
                    "attention"
                )
        if queries == "cls" and not spec.cls:
            raise ValueError(
                "tower_attention with queries='cls' needs a tower with a CLS token (CLIP); this "
                "one has none: use queries='mean' or 'auto'"
            )
        self.spec = spec
        self.cls = spec.cls if queries == "auto" else queries == "cls"
        self.received: torch.Tensor | None = None  # [I, H, T]

    @classmethod
    def for_stages(cls, adapter, stages) -> TowerTap | None:
        """A tap for the stages whose relevance ``reads_tower`` (None without any).

        Raises:
            ValueError: two such stages ask for different query rows.
            NotImplementedError: the adapter cannot expose its tower's attention.
        """
        wanted = {
            getattr(s.relevance, "queries", "auto") for s in stages if s.relevance.reads_tower
        }
        if not wanted:
            return None
        if len(wanted) > 1:
            raise ValueError(
                f"the stages read the tower's attention with different queries {sorted(wanted)}: "
                "use one"
            )
        return cls(adapter.tower_spec(), wanted.pop())

    @classmethod
    def at_layer(cls, adapter, layer: int, policy) -> TowerTap:
        """A tap on 0-based tower layer ``layer``, which ``policy`` reads (its ``tower_layers``;
        the CLS row where the tower has one, else the mean over queries).

        Raises:
            ValueError: the tower has no such layer (one line naming the layer and the policy).
            NotImplementedError: the adapter cannot expose its tower's attention.
        """
        try:
            spec = adapter.tower_spec(layer)
        except IndexError as e:
            knob = [f.name for f in fields(policy) if getattr(policy, f.name) == layer]
            raise ValueError(
                f"the {policy.name} {policy.family} reads vision tower layer {layer}, but {e}: set "
                f"{'its ' + knob[0] if knob else 'it'} to a layer the tower has"
            ) from None
        return cls(spec)

    def install(self) -> list[Any]:
        """Register the hook; returns the handles (removed by the session)."""
        return [self.spec.attention.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def clear(self) -> None:
        """Forget the last call (the forward that read it has ended)."""
        self.received = None

    @torch.no_grad()
    def _hook(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        heads = int(
            getattr(module, "num_heads", 0)
            or getattr(module, "num_attention_heads", 0)
            or module.config.num_attention_heads
        )
        i, t, _ = x.shape
        acc = torch.promote_types(x.dtype, torch.float32)
        k = module.k_proj(x).view(i, t, heads, -1).transpose(1, 2).to(acc)  # [I, H, T, d]
        scale = float(getattr(module, "scale", getattr(module, "scaling", k.shape[-1] ** -0.5)))
        rows = range(0, 1) if self.cls else range(0, t, CHUNK)
        out = torch.zeros(i, heads, t, dtype=acc, device=x.device)
        for start in rows:
            stop = start + 1 if self.cls else min(t, start + CHUNK)
            q = (
                module.q_proj(x[:, start:stop])
                .view(i, stop - start, heads, -1)
                .transpose(1, 2)
                .to(acc)
            )
            out += torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1).sum(dim=2)
        if not self.cls:
            out /= t
        self.received = out
        return None

    def per_token(self, layout: VisionLayout) -> torch.Tensor:
        """``[B, H, N]``: the attention each current vision token's original patch received
        (zero elsewhere), found by its image and grid coordinates (images in the order the
        tower saw them; patches in raster order after the CLS token, if any).

        Raises:
            RuntimeError: the tower did not run in this forward, or saw other images.
        """
        if self.received is None:
            raise RuntimeError(
                "the vision tower did not run in this forward: tower relevance needs the image "
                "inputs (pixel_values) in the prefill call"
            )
        att = self.received
        images, heads, tokens = att.shape
        grid = layout.image_grid
        off = 1 if self.spec.cls else 0
        if layout.num_images != images or bool(((grid[:, 0] * grid[:, 1]) + off != tokens).any()):
            raise RuntimeError(
                f"the tower saw {images} image(s) of {tokens - off} patches but the prompt holds "
                f"{layout.num_images} with grids {grid.tolist()}: tower relevance needs one tower "
                "pass over exactly the prompt's images"
            )
        vision = layout.vision_mask
        img = layout.image[vision]
        patch = off + layout.coords[..., 0][vision] * grid[img, 1] + layout.coords[..., 1][vision]
        out = att.new_zeros(layout.batch_size, heads, layout.seq_len)
        rows = torch.nonzero(vision, as_tuple=True)
        out[rows[0], :, rows[1]] = att[img, :, patch]
        return out
