"""`CacheStage`: a `Stage` applied to one layer's cached keys and values (the cache mode).

The same graph machinery as a hidden-state stage (partitioner, scorer, pruner, passer),
with the cache in place of the residual stream: every cache entry is a token whose
"hidden state" is its key and value side by side (``[H_kv * d]`` each, all heads), and
whose ``key_states`` features (for key-space scorers) are the cached keys, per head. The passer
merges a token's key and value with the same weights, so a merged entry is a convex
combination of its sources' entries (keys and values alike). Cached keys are post-RoPE:
merging them mixes rotations, which is what cache-merging methods (ElasticCache) do.

Pure: tensors in, tensors out. `lightkv.adapters` calls it on each scheduled layer's
cache right after the layer's prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .graph.layout import VisionLayout
from .graph.provenance import Provenance
from .stage import Stage, StageResult

__all__ = ["CacheResult", "CacheStage"]


@dataclass(frozen=True)
class CacheResult:
    """What a cache stage returns.

    Attributes:
        keys, values: ``[B, H_kv, N', d]`` the layer's new cache (holes zero).
        result: the `StageResult` (its ``layout`` describes the new entries: ``origin`` is
            each entry's original column, the destination's for a merged entry, ``-1`` for
            holes; its ``hidden`` is the flattened keys and values).
    """

    keys: torch.Tensor
    values: torch.Tensor
    result: StageResult

    @property
    def valid(self) -> torch.Tensor:
        """``[B, N']`` bool: real entries."""
        return self.result.layout.valid_mask

    @property
    def origin(self) -> torch.Tensor:
        """``[B, N']`` original column of each entry (``-1`` holes)."""
        return self.result.layout.origin


@dataclass
class CacheStage:
    """A `Stage` on a layer's cache.

    Attributes:
        stage: the composed policies and the schedule entry (``stage.spec.mode`` is ``"cache"``
            when it comes from a `lightkv.policies.CacheSchedule`).
    """

    stage: Stage

    @staticmethod
    def tokens(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [B, N, 2 * H_kv * d], key features [B, N, H_kv, d])`` of a cache (the
        key features are a view of the hidden's first half)."""
        if keys.dim() != 4 or values.shape[:3] != keys.shape[:3]:
            raise ValueError(
                f"expected keys and values [B, H_kv, N, d], got {tuple(keys.shape)} and "
                f"{tuple(values.shape)}"
            )
        b, h, n, dk = keys.shape
        k, v = keys.transpose(1, 2), values.transpose(1, 2)
        # one pass into the result (flatten-then-cat copied each half twice: 2 x 97 MB of
        # fresh pages per layer at 7B width and 2,970 tokens)
        hidden = keys.new_empty(
            (b, n, h * (dk + values.shape[-1])), dtype=torch.promote_types(keys.dtype, values.dtype)
        )
        key_features = hidden[..., : h * dk].view(b, n, h, dk)
        key_features.copy_(k)
        hidden[..., h * dk :].view(b, n, h, values.shape[-1]).copy_(v)
        # the view: a key's heads are one contiguous row, which window blocks copy at once
        return hidden, key_features

    @staticmethod
    def split(hidden: torch.Tensor, keys_like: torch.Tensor, values_like: torch.Tensor):
        """Back from ``[B, N', 2 * H_kv * d]`` to ``(keys, values)`` ``[B, H_kv, N', d]``."""
        b, n = hidden.shape[:2]
        h, dk, dv = keys_like.shape[1], keys_like.shape[-1], values_like.shape[-1]
        k = hidden[..., : h * dk].reshape(b, n, h, dk).transpose(1, 2)
        v = hidden[..., h * dk :].reshape(b, n, h, dv).transpose(1, 2)
        return k.to(keys_like.dtype).contiguous(), v.to(values_like.dtype).contiguous()

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: VisionLayout,
        relevance: torch.Tensor | None = None,
        provenance: Provenance | None = None,
        finish: Callable[[StageResult], StageResult] | None = None,
    ) -> CacheResult:
        """Run the stage on a cache.

        Args:
            keys: ``[B, H_kv, N, d]`` the layer's cached keys, one entry per token of
                ``layout``.
            values: ``[B, H_kv, N, d]`` its cached values.
            layout: the tokens' layout.
            relevance: ``[B, N]`` importance (None: uniform).
            provenance: as for `Stage` (None: the entries are original tokens).
            finish: applied to the `StageResult` before the cache is rebuilt (the adapters
                pass `lightkv.adapters.masks.drop_padding`).
        """
        hidden, key_features = self.tokens(keys, values)
        # the stage promotes what it computes with (window blocks, merged rows) itself
        result = self.stage(hidden, layout, relevance, provenance, key_features)
        if finish is not None:
            result = finish(result)
        k, v = self.split(result.hidden, keys, values)
        return CacheResult(k, v, result)
