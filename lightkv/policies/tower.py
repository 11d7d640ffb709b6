"""`TowerAttention`: relevance read inside the vision tower, before the language model sees the
image.

VisionZip (Yang et al., CVPR 2025, arXiv:2412.04467) and VisPruner (Zhang et al., ICCV
2025, arXiv:2412.01818) rank an image's tokens by the attention they receive in the vision
encoder: from the CLS token in CLIP, or averaged over every query where the encoder has no
CLS (SigLIP). That attention is prompt-agnostic; it marks the tokens the encoder itself
gathers information into. An adapter computes it from the tower's own projections at the
layer whose output the projector reads (no ``N x N`` matrix is stored: the CLS row is one
query; the mean over queries is accumulated in chunks) and hands it to a policy that
declares ``reads_tower``:

```python
import torch
from lightkv import ImageSegment, VisionLayout
from lightkv.policies import TowerAttention
layout = VisionLayout.from_segments(1, 6, [ImageSegment(row=0, offset=1, grid=(2, 2))])
tower = torch.zeros(1, 2, 6)                       # [B, H, N]: attention received per head
tower[0, :, 1:5] = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.2, 0.2, 0.5, 0.1]])
TowerAttention().score(None, None, layout, tower=tower)   # summed over heads
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .relevance import Heads, Relevance, _check_heads, _reduce_heads

__all__ = ["TowerAttention"]


@Relevance.register("tower_attention")
@dataclass
class TowerAttention(Relevance):
    """Attention each vision token receives inside the vision tower, reduced over heads.

    VisionZip's dominant-token score: the CLS row of the attention at the tower layer
    whose hidden states the projector reads (``vision_feature_layer``, -2 in LLaVA-1.5),
    summed over heads (``cls_attention = attn[:, :, 0, 1:].sum(dim=1)`` in VisionZip's
    ``visionzip/clip_encoder.py``, ``CLIPVisionTower_VisionZip.forward``). Where the tower
    has no CLS token, adapters give the attention received averaged over all queries.
    It does not depend on the prompt; no LLM layer is projected for it.

    Attributes:
        heads: ``sum`` (VisionZip), ``mean`` or ``max`` over the tower's heads.
        queries: which query rows the adapter reads: ``cls`` (the CLS token's row; a tower
            without CLS is refused), ``mean`` (the attention received averaged over every
            query, SigLIP-style) or ``auto`` (``cls`` where the tower has one, else
            ``mean``: the methods' own rule).
    """

    query_rows: ClassVar[str] = "none"
    key_cols: ClassVar[str] = "none"
    reads_tower: ClassVar[bool] = True
    heads: Heads = "sum"
    queries: Literal["auto", "cls", "mean"] = "auto"

    def __post_init__(self) -> None:
        _check_heads(self.heads)
        if self.queries not in ("auto", "cls", "mean"):
            raise ValueError(f"unknown queries {self.queries!r}; choose auto, cls or mean")

    def score(self, queries, keys, layout, tower=None):
        """``tower [B, H, N]`` (attention received per head, any value off vision tokens) ->
        ``[B, N]``."""
        if tower is None:
            raise ValueError(
                "tower_attention reads the vision tower's attention: inside a model the adapter "
                "passes it (LLaVA-family towers); in a direct call pass tower=[B, H, N]"
            )
        if tower.dim() != 3 or tuple(tower.shape[::2]) != (layout.batch_size, layout.seq_len):
            raise ValueError(
                "tower attention must be [B, H, N] with B, N = "
                f"{(layout.batch_size, layout.seq_len)}, got {tuple(tower.shape)}"
            )
        xi = _reduce_heads(tower.to(torch.promote_types(tower.dtype, torch.float32)), self.heads)
        return torch.where(layout.vision_mask, xi.clamp_min(0), torch.zeros_like(xi))
