"""`MaskedCacheLayer`: the cache layer of a compressed decoder layer, which remembers which
of its entries are holes, and the session's open/closed flag its layers share."""

from __future__ import annotations

import torch
from torch.nn.functional import pad
from transformers.cache_utils import DynamicLayer

from ..bias import expand_keys, expand_values, log_sizes

__all__ = ["MaskedCacheLayer"]


class _Token:
    """Shared open/closed flag of one session."""

    def __init__(self) -> None:
        self.open = True


class MaskedCacheLayer(DynamicLayer):
    """A `DynamicLayer` of a compressed decoder layer: shorter than the prompt, possibly
    with holes (rows that kept fewer tokens, input padding), recorded in ``valid``.

    ``valid`` (``[B, L]`` bool, True for real entries) and ``origin`` (``[B, L]`` long, the
    original sequence column of each entry, ``-1`` for holes; what a sliding window is
    measured in) and, with proportional attention, ``sizes`` (``[B, L]`` long, how many
    original tokens each entry stands for; None while every entry stands for one) follow
    the cache through beam search (`reorder_cache`), `batch_select_indices` and
    `batch_repeat_interleave`. On proportional attention's channel route (FlashAttention-2)
    a layer with merged entries holds ``K' = [K, log(size) * channel]`` and ``V' = [V, 0]``
    (head dim ``d + 1``; ``channel`` is ``1 / scale``, set while it does), every later
    entry with a 0 there (``log 1``); `plain` gives the entries without that column.
    Cropping is refused: compressed layers hold different numbers of entries, so "remove
    the last k tokens" has no single meaning (assisted decoding is not supported).
    """

    is_croppable = False

    def __init__(self, token: _Token | None = None):
        super().__init__()
        self._start(token)

    def _start(self, token: _Token | None) -> None:
        """The hole bookkeeping, empty (also for a quantized layer built from an existing one)."""
        self.valid: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.origin: torch.Tensor | None = None
        self.pending_origin: torch.Tensor | None = None
        self.columns: int | None = None
        self.pending_columns: int | None = None  # the prompt's original width, set at prefill
        self.sizes: torch.Tensor | None = None
        self.pending_sizes: torch.Tensor | None = (
            None  # set at prefill when a token stands for several
        )
        self.channel: float | None = None
        """Set while the keys and values carry proportional attention's bias column."""
        self.pending_channel: float | None = None  # set at prefill with pending_sizes
        self.extra: dict[str, torch.Tensor] = {}
        """``[B, ...]`` tensors of the cache mode (H2O's accumulated scores, candidates and
        budgets) that follow the rows through beam search like ``valid``."""
        self._token = token or _Token()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self._token.open:
            raise RuntimeError(
                "this cache was compressed by a lightkv session that has ended; its compressed "
                "layers need the session's masks: decode inside the `with lightkv.apply(pipeline, "
                "model):` block"
            )
        channel, self.pending_channel = self.pending_channel, None
        if channel is not None and self.pending_sizes is not None:
            key_states = expand_keys(
                key_states, log_sizes(self.pending_sizes, key_states.dtype), channel
            )
            value_states, self.channel = expand_values(value_states), channel
        elif self.channel is not None:  # decoded tokens stand for themselves: log 1 = 0
            key_states, value_states = (pad(t, (0, 1)) for t in (key_states, value_states))
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = self.pending
        if new is None:
            new = torch.ones(
                key_states.shape[0],
                key_states.shape[-2],
                dtype=torch.bool,
                device=key_states.device,
            )
        self.pending = None
        new = new.to(keys.device)
        self.valid = new if self.valid is None else torch.cat([self.valid, new], dim=1)
        org = self.pending_origin
        self.pending_origin = None
        if org is not None:
            org = org.to(keys.device)
            self.origin = org if self.origin is None else torch.cat([self.origin, org], dim=1)
        sizes, self.pending_sizes = self.pending_sizes, None
        if sizes is not None:
            self.sizes = sizes.to(keys.device)
        elif self.sizes is not None:  # decoded tokens stand for themselves
            one = torch.ones(new.shape, dtype=self.sizes.dtype, device=self.sizes.device)
            self.sizes = torch.cat([self.sizes, one], dim=1)
        # Counted on the host (no device sync on the decode path): the prompt's width, then
        # one column per new token.
        if self.pending_columns is not None:
            self.columns, self.pending_columns = self.pending_columns, None
        elif self.columns is not None:
            self.columns += key_states.shape[-2]
        return keys, values

    def get_seq_length(self) -> int:
        """The original sequence columns seen so far (the prompt's, then one per decoded
        token), not the entries held: the model numbers new tokens' positions from it, so
        with every layer compressed (the pre-LLM mode) decoding continues at the right
        position."""
        return self.columns if self.columns is not None else super().get_seq_length()

    def plain(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[B, H_kv, L, d]`` without the bias column (`channel`)."""
        assert self.keys is not None and self.values is not None, "an empty cache layer"
        if self.channel is None:
            return self.keys, self.values
        return self.keys[..., :-1], self.values[..., :-1]

    def replace(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        origin: torch.Tensor,
        sizes: torch.Tensor | None = None,
        channel: float | None = None,
    ) -> None:
        """Put a compressed cache in place (the cache mode, after the layer's prefill or a
        decoding step): ``[B, H_kv, L', d]`` keys and values with their ``[B, L']`` validity,
        original columns and, for proportional attention, sizes (None: every entry stands
        for one) and, on its channel route, ``1 / scale`` of the layer (the entries are then
        stored with the bias column). ``columns`` (the original columns seen) does not
        change."""
        if keys.shape[2] != valid.shape[1] or valid.shape != origin.shape:
            raise ValueError("keys, valid and origin disagree on the number of entries")
        if sizes is not None and sizes.shape != valid.shape:
            raise ValueError("sizes and valid disagree on the number of entries")
        self.channel = channel if sizes is not None else None
        if self.channel is not None and sizes is not None:
            keys = expand_keys(keys, log_sizes(sizes, keys.dtype), self.channel)
            values = expand_values(values)
        self.keys, self.values = keys, values
        self.valid, self.origin = valid.bool(), origin.long()
        self.sizes = None if sizes is None else sizes.long()

    def _rows(self, fn) -> None:
        if self.valid is not None:
            self.valid = fn(self.valid)
        if self.origin is not None:
            self.origin = fn(self.origin)
        if self.sizes is not None:
            self.sizes = fn(self.sizes)
        self.extra = {k: fn(v) for k, v in self.extra.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._rows(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "a lightkv-compressed cache cannot be cropped (compressed layers hold fewer entries "
            "than the prompt); assisted / speculative decoding and cache rollback are not "
            "supported inside a compression session"
        )

    def reset(self) -> None:
        super().reset()
        self.valid = self.pending = self.origin = self.pending_origin = None
        self.columns = self.pending_columns = None
        self.sizes = self.pending_sizes = None
        self.channel = self.pending_channel = None
        self.extra = {}
