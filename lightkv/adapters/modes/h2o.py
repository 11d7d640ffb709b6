"""The ``h2o`` mode: heavy-hitter eviction of listed layers' caches after the prefill and
after every decoding step (`H2OMode`, whose fields are its settings; no stage is planned).

A token's score is the causal attention it receives, accumulated over the prompt's queries
and then every decoded token's queries against the kept entries, computed from the layer's
own projections: at the prefill read as the layer computes them (`CacheEntriesMode`'s
tap), while decoding projected again for the few new tokens. Evicted entries never come
back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ...graph.layout import TokenKind
from ...graph.scatter import right_align
from ...methods.cache_policies import accumulated_attention, accumulated_attention_flops, h2o_keep
from ...policies.relevance import _match_heads
from ...policies.schedulers.knob import check_target, out_of_reach
from ..cache import MaskedCacheLayer
from ..masks import _batch
from ..probes import AttentionProbe
from .base import LayerCall, Mode
from .cache import CacheEntriesMode

__all__ = ["H2OMode", "evict"]


def _scale(probe: AttentionProbe) -> float:
    scale = getattr(probe.attn, "scaling", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(probe.head_dim)


def _queries_keys(
    probe: AttentionProbe, call: LayerCall, raw: dict[str, torch.Tensor] | None = None
):
    """Post-RoPE queries and keys of the layer's tokens: from its raw projection outputs
    when given, else from its input projected again."""
    pos = call.kwargs.get("position_embeddings")
    if pos is None:
        raise RuntimeError(
            f"layer {call.layer} received no position_embeddings; cannot score its cache for H2O"
        )
    hidden = call.hidden
    cos, sin = _batch(pos[0], hidden.shape[0]), _batch(pos[1], hidden.shape[0])
    if raw is not None:
        return probe.queries_from(raw, cos, sin), probe.keys_from(raw, cos, sin)
    x = probe.normed(hidden)
    return probe.queries(x, cos, sin), probe.keys(x, cos, sin)


def _layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """The evicting layers of a ``num_layers`` decoder (None: every layer)."""
    if layers is None:
        return list(range(num_layers))
    if layers and layers[-1] >= num_layers:
        raise ValueError(
            f"the h2o mode evicts on layer {layers[-1]}, but the model has only {num_layers} layers"
        )
    return list(layers)


@Mode.register("h2o")
@dataclass
class H2OMode(CacheEntriesMode):
    """Heavy-hitter eviction (H2O, Zhang et al., NeurIPS 2023, arXiv:2306.14048), per layer.

    After the prefill and after every decoding step, each listed layer keeps, per batch
    row, the ``recent`` most recent candidate entries plus the ``heavy`` candidates with the
    largest attention accumulated so far (over the prompt's queries, then every decoded
    token's), and evicts the other candidates (`lightkv.methods.h2o_keep`). Evicted entries
    never come back. The budget is fixed at prefill: ``floor(budget * n)`` entries for the
    ``n`` candidate tokens of the row's prompt, ``floor(recent_share * that)`` of them recent.
    The mode plans no stage: a pipeline runs it as its own mode (``mode: {name: h2o}``).

    Attributes:
        budget: kept candidates as a fraction of the prompt's (may exceed 1: room for
            generated tokens before eviction starts).
        recent_share: the share of the budget that goes to the most recent candidates.
        tokens: ``vision`` (only vision tokens are candidates; text, structural and
            generated tokens always stay, so eviction happens once, after prefill) or
            ``all`` (every token is a candidate, the paper's setting: the cache stays at
            the budget while decoding, one eviction per step).
        layers: the layers that evict (None: every layer).
    """

    beside_stages = False  # it scores and evicts the uncompressed prompt's cache

    budget: float = 0.5
    recent_share: float = 0.5
    tokens: Literal["vision", "all"] = "vision"
    layers: tuple[int, ...] | None = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not float(self.budget) > 0.0:
            raise ValueError(f"budget must be > 0, got {self.budget!r}")
        if isinstance(self.recent_share, bool) or not 0.0 <= float(self.recent_share) <= 1.0:
            raise ValueError(f"recent_share must be in [0, 1], got {self.recent_share!r}")
        if self.tokens not in ("vision", "all"):
            raise ValueError(f"tokens must be 'vision' or 'all', got {self.tokens!r}")
        if self.layers is not None:
            layers = list(self.layers)
            if not layers:  # accepted once and evicted nothing, silently
                raise ValueError(
                    "layers is empty, so nothing would be evicted: list the layers that evict, "
                    "or leave layers out for every layer"
                )
            bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or x < 0]
            if bad or layers != sorted(set(layers)):
                raise ValueError(f"layers must be strictly increasing integers >= 0, got {layers}")
            self.layers = tuple(layers)

    def check_depth(self, num_layers: int) -> None:
        _layers(self.layers, num_layers)

    def evict_layers(self, num_layers: int) -> list[int]:
        """The layers that evict, for a decoder of ``num_layers`` layers."""
        return _layers(self.layers, num_layers)

    def target_kept_fraction(self, num_layers: int) -> float | None:
        """Each evicting layer keeps ``min(budget, 1)`` of its candidates, the others all."""
        at = len(_layers(self.layers, num_layers))
        return (at * min(float(self.budget), 1.0) + num_layers - at) / num_layers

    def at_kept_fraction(self, kept_fraction: float, num_layers: int) -> H2OMode:
        """The budget that keeps ``kept_fraction`` averaged over ``num_layers`` layers:
        ``kept_fraction`` itself when every layer evicts, more where only some do.

        Raises:
            KeptFractionOutOfReach: the listed layers cannot evict that much.
        """
        t = check_target(kept_fraction)
        at = len(_layers(self.layers, num_layers))
        budget = 1.0 - (1.0 - t) * num_layers / at
        if budget <= 0.0:  # the layers that do not evict keep more than the target
            how = f"eviction on {at} of its layers (the others keep everything)"
            raise out_of_reach(t, (num_layers - at) / num_layers, num_layers, how)
        return replace(self, budget=t if at == num_layers else round(budget, 6))

    def knob(self) -> str:
        return "its budget: each evicting layer keeps that share of its vision entries"

    def counts(self, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(heavy, recent)`` ``[B]`` int64 from the prompt's candidate counts ``[B]``."""
        total = (candidates.double() * float(self.budget) + 1e-9).floor().long()
        recent = (total.double() * float(self.recent_share) + 1e-9).floor().long()
        return total - recent, recent

    def start(self) -> None:
        self.start_cache(self.evict_layers(self.ctx.num_layers))
        self.every_token = self.tokens == "all"
        # H2O over every token also evicts in a prompt without vision tokens
        self.text_too = self.every_token and bool(self.layers)

    def reads_projections(self, layer):
        return True

    def importance(self, call, raw=None):
        probe, layout = self.ctx.probes[call.layer], call.state.layout
        q, k = _queries_keys(probe, call, raw)
        xi = accumulated_attention(q, k, layout.valid_mask, layout.origin, _scale(probe))
        b, n = layout.batch_size, layout.seq_len
        flops = (
            0.0
            if raw is not None
            else 2.0 * b * n * probe.hidden * (probe.heads + probe.kv_heads) * probe.head_dim
        )
        return xi, flops + accumulated_attention_flops(
            layout.valid_mask, layout.origin, probe.heads, probe.head_dim
        )

    def rewrite(self, call, layer, importance):
        layout = call.state.layout
        valid = layer.valid
        candidate = valid.clone() if self.every_token else valid & (layout.kind == TokenKind.VISION)
        heavy, recent = self.counts(candidate.sum(1))
        layer.extra.update(
            scores=importance.double(),
            candidate=candidate,
            heavy=heavy,
            recent=recent,
            kind=layout.kind.clone(),
        )
        self._evict(layer)
        return layer.extra["kind"]

    def _decoding(self, call: LayerCall) -> MaskedCacheLayer | None:
        # vision-only: decoding adds no candidates, so nothing more is ever evicted
        cache = call.cache
        if not self.every_token or cache is None or len(cache.layers) <= call.layer:
            return None
        layer = cache.layers[call.layer]
        return layer if isinstance(layer, MaskedCacheLayer) and "scores" in layer.extra else None

    def decode_pre(self, call: LayerCall) -> None:
        """Add the new tokens' attention over the kept entries (and themselves) to the scores."""
        layer = self._decoding(call)
        if layer is None:
            return
        probe = self.ctx.probes[call.layer]
        b, q = call.hidden.shape[:2]
        # a scored layer holds the prompt's entries; every forward's state has new_valid
        assert layer.valid is not None and layer.keys is not None
        assert call.state.new_valid is not None
        with torch.no_grad():
            qn, kn = _queries_keys(probe, call)
            acc = torch.promote_types(qn.dtype, torch.float32)
            keys = _match_heads(
                torch.cat([layer.plain()[0].to(acc), kn.to(acc)], dim=2), probe.heads
            )
            new_valid = call.state.new_valid.to(layer.valid.device)
            valid = torch.cat([layer.valid, new_valid], dim=1)
            past, total = layer.valid.shape[1], valid.shape[1]
            col = torch.arange(total, device=valid.device)
            me = past + torch.arange(q, device=valid.device)
            allowed = valid.unsqueeze(1) & (col.unsqueeze(0) <= me.unsqueeze(1)).unsqueeze(0)
            allowed |= (col.unsqueeze(0) == me.unsqueeze(1)).unsqueeze(0)
            logits = torch.matmul(qn.to(acc), keys.transpose(-1, -2)) * _scale(
                probe
            )  # [B, H, q, L + q]
            attn = torch.softmax(logits.masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1)
            add = (attn * new_valid[:, None, :, None]).sum(dim=(1, 2)).double()
        ex = layer.extra
        ex["scores"] = torch.cat([ex["scores"], ex["scores"].new_zeros(b, q)], dim=1) + add
        ex["candidate"] = torch.cat([ex["candidate"], new_valid], dim=1)
        ex["kind"] = torch.cat(
            [ex["kind"], torch.full_like(new_valid, int(TokenKind.TEXT), dtype=ex["kind"].dtype)], 1
        )

    def decode_post(self, call: LayerCall) -> None:
        """Evict to the budget."""
        layer = self._decoding(call)
        if layer is not None:
            self._evict(layer)

    @staticmethod
    def _evict(layer: MaskedCacheLayer) -> None:
        ex = layer.extra
        valid = layer.valid
        assert valid is not None and layer.origin is not None  # a scored layer has its entries
        keep = (
            h2o_keep(ex["scores"], ex["candidate"] & valid, layer.origin, ex["heavy"], ex["recent"])
            & valid
        )
        moved = evict(layer, keep)
        if moved is not None:
            ex["scores"], ex["candidate"] = moved(ex["scores"], 0.0), moved(ex["candidate"], False)
            ex["kind"] = moved(ex["kind"], int(TokenKind.PAD))


def evict(layer: MaskedCacheLayer, keep: torch.Tensor):
    """Keep only the entries where ``keep`` (``[B, L]`` bool, within ``layer.valid``) holds,
    right-aligned, holes on the left (what every compressed cache looks like).

    Returns:
        None when nothing was evicted; otherwise a function ``moved(t, fill)`` that moves
        any other per-entry tensor ``[B, L]`` the same way (``fill`` in the new holes).
    """
    valid = layer.valid
    assert valid is not None and layer.origin is not None  # a filled masked layer
    assert layer.keys is not None and layer.values is not None
    if bool((keep == valid).all()):
        return None
    index, _ = right_align(keep)
    hole = index < 0
    idx = index.clamp_min(0)

    def moved(t: torch.Tensor, fill) -> torch.Tensor:
        return t.gather(1, idx).masked_fill(hole, fill)

    def cache(t: torch.Tensor) -> torch.Tensor:
        g = t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))
        return g.masked_fill(hole[:, None, :, None], 0)

    sizes = None if layer.sizes is None else moved(layer.sizes, 1)
    keys, values = layer.plain()
    layer.replace(
        cache(keys),
        cache(values),
        moved(valid, False),
        moved(layer.origin, -1),
        sizes,
        layer.channel,
    )
    return moved
