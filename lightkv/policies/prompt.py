"""`Prompt`: the prefill's token ids, for policies conditioned on what the prompt says.

A relevance policy that declares ``reads_prompt = True`` receives the prompt with its
queries and keys (adapters pass it from the forward's ``input_ids``; a test builds one from
a tensor). Ids are kept at their original positions, so a policy maps the current
(possibly compressed) sequence to them through ``layout.origin``:

```python
import torch
from lightkv import ImageSegment, VisionLayout
from lightkv.policies import Prompt
layout = VisionLayout.from_segments(1, 8, [ImageSegment(row=0, offset=1, grid=(2, 2))])
prompt = Prompt(torch.tensor([[1, 3, 3, 3, 3, 4, 9, 7]]))
prompt.ids(layout)             # tensor([[ 1, -1, -1, -1, -1,  4,  9,  7]])
prompt.question_mask(layout)   # text after the row's last vision token
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..graph.layout import VisionLayout

__all__ = ["Prompt"]


@dataclass(frozen=True)
class Prompt:
    """The token ids of a prefill, at their original positions.

    Attributes:
        token_ids: ``[B, N0]`` int64, the ``input_ids`` of the prefill (``N0``: the
            uncompressed length; padding positions hold whatever the caller padded with).
    """

    token_ids: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, torch.Tensor) or self.token_ids.dim() != 2:
            raise ValueError("Prompt.token_ids must be a [B, N] tensor of token ids")
        if self.token_ids.is_floating_point():
            raise TypeError(f"Prompt.token_ids must hold integer ids, got {self.token_ids.dtype}")

    def ids(self, layout: VisionLayout) -> torch.Tensor:
        """``[B, N]`` int64: the id of each current text token of ``layout``, -1 for vision,
        padding and structural tokens and for holes."""
        if layout.batch_size != self.token_ids.shape[0]:
            raise ValueError(
                f"the prompt has {self.token_ids.shape[0]} rows, the layout {layout.batch_size}"
            )
        origin = layout.origin.clamp_min(0)
        if origin.numel() and int(origin.max()) >= self.token_ids.shape[1]:
            raise ValueError(
                "the layout reaches past the prompt's length: the prompt is not this prefill's"
            )
        ids = self.token_ids.to(origin.device).long().gather(1, origin)
        return torch.where(layout.text_mask & (layout.origin >= 0), ids, torch.full_like(ids, -1))

    def question_mask(self, layout: VisionLayout) -> torch.Tensor:
        """``[B, N]`` bool: text tokens after the row's last vision token (the question of a
        prompt that puts the image first; the whole text of a text-only row)."""
        pos = torch.arange(layout.seq_len, device=layout.kind.device).expand(layout.batch_size, -1)
        last = torch.where(layout.vision_mask, pos, torch.full_like(pos, -1)).amax(1, keepdim=True)
        return layout.text_mask & (pos > last)

    def match(self, layout: VisionLayout, ids: Sequence[int]) -> torch.Tensor:
        """``[B, N]`` bool: current text tokens whose id is one of ``ids``."""
        wanted = torch.as_tensor(list(ids), dtype=torch.long, device=layout.kind.device)
        return torch.isin(self.ids(layout), wanted)
