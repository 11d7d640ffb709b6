"""The released code's model-level quirks inside a session (`lightkv.quirks.ReleasedQuirks`):
positions renumbered after a merge, the first merge layer without a causal mask, and the
merge layers' attention computed eagerly.

Internals of `lightkv.adapters.session`; a no-op unless a quirk is on. All act during
prefill only: decoding keeps the model's own positions (the original prompt length
onwards), causal masks and attention implementation, as the released code does.

Eager merge layers: nothing global changes (the registry ``ALL_ATTENTION_FUNCTIONS`` and
the classes are never touched). The session arms a merge layer just before it runs in a
prefill (`arm`); a forward pre-hook on that layer's attention module then replaces the
module's ``config`` attribute, on this instance only, by `EagerConfigView` (the same config
naming ``eager``), and a forward hook that runs even when the call raises puts the original
object back. Between calls, and after the session, every module holds its original config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..graph.layout import VisionLayout
from ..quirks import RELEASED_FAMILIES, ReleasedQuirks
from ..stage import Stage
from .base import Adapter
from .masks import FLASH, finish_mask, flash_mask, prefill_mask

__all__ = ["EagerConfigView", "ReleasedQuirksHook", "renumbered_ids"]

EAGER = "eager"


class EagerConfigView:
    """A read-only view of a model config that names the ``eager`` attention implementation:
    every other attribute is the wrapped config's (the modeling code reads
    ``self.config._attn_implementation`` to choose its attention function)."""

    __slots__ = ("_base",)
    _attn_implementation = EAGER

    def __init__(self, base: Any) -> None:
        object.__setattr__(self, "_base", base)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"lightkv's eager view of the model config is read-only (setting {name!r})"
        )


def renumbered_ids(valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` plain positions of a compressed sequence: the ``k``-th real token of a row
    gets ``k`` (so a row gets the same positions alone or left-padded in a batch); holes get
    0 (they are masked)."""
    return (valid.long().cumsum(dim=1) - 1).clamp_min(0)


class ReleasedQuirksHook:
    """The quirks of one session.

    Args:
        adapter: the session's family adapter.
        quirks: `lightkv.Pipeline.released_quirks`.
        language_model: the decoder stack (its ``rotary_emb`` gives the renumbered positions'
            embeddings, exactly as the model computes its own).
        stages: the pipeline's stages for this model.

    Raises:
        NotImplementedError: a quirk is on for a family the released code never supported,
            or together with pre-LLM or cache stages, which it never had.
    """

    def __init__(
        self, adapter: Adapter, quirks: ReleasedQuirks, language_model, stages: Sequence[Stage]
    ):
        self.quirks = quirks
        self.first_merge: int | None = None
        self.eager_layers: frozenset[int] = frozenset()
        """The decoder layers whose attention runs eagerly during prefill (`eager_merge_layers`)."""
        self._attention: dict[int, nn.Module] = {}
        self._armed: int | None = None
        self._swapped: dict[int, Any] = {}
        self._rotary = None
        if not quirks.any:
            return
        on = ", ".join(quirks.enabled())
        if adapter.family not in RELEASED_FAMILIES:
            raise NotImplementedError(
                f"released_quirks ({on}) reproduce the authors' released code, which supports "
                f"{' and '.join(RELEASED_FAMILIES)} only, not the {adapter.family!r} family; "
                "turn them off (use lightkv-paper instead of lightkv-paper-released)"
            )
        if any(s.spec.mode == "pre_llm" or s.spec.mode == "cache" for s in stages):
            raise NotImplementedError(
                f"released_quirks ({on}) apply to merges after a decoder layer; the released code "
                "has no pre-LLM or cache stages: turn the quirks off or use a schedule of decoder "
                "layers"
            )
        if (
            quirks.unmasked_first_merge
        ):  # a stage of ratio 0 merges nothing: the quirks then change nothing
            self.first_merge = min(
                (s.spec.layer for s in stages if s.spec.removal_ratio > 0), default=None
            )
        if quirks.eager_merge_layers:
            self.eager_layers = frozenset(s.spec.layer for s in stages if s.spec.removal_ratio > 0)
            layers = list(adapter.decoder_layers())
            for i in sorted(self.eager_layers):
                attn = getattr(layers[i], "self_attn", None)
                if attn is None or getattr(attn, "config", None) is None:
                    raise NotImplementedError(
                        "eager_merge_layers switches a merge layer's attention module to eager "
                        f"through its config, but decoder layer {i} ({type(layers[i]).__name__}) "
                        "has no self_attn.config; turn the quirk off"
                    )
                self._attention[i] = attn
        if quirks.renumber_positions:
            self._rotary = getattr(language_model, "rotary_emb", None)
            if not callable(self._rotary):
                raise NotImplementedError(
                    "renumber_positions needs the decoder's rotary embedding "
                    f"({type(language_model).__name__}.rotary_emb); turn the quirk off"
                )

    # ------------------------------------------------------------ eager merge layers
    def eager(self, layer: int) -> bool:
        """Whether ``layer`` runs its attention eagerly during prefill (`eager_merge_layers`)."""
        return layer in self.eager_layers

    def install(self) -> list[Any]:
        """The hooks on the eager merge layers' attention modules (none when the quirk is
        off); the session removes them with its own."""
        handles = []
        for i, attn in self._attention.items():
            handles.append(attn.register_forward_pre_hook(lambda m, args, i=i: self._swap(i, m)))
            handles.append(
                attn.register_forward_hook(
                    lambda m, args, out, i=i: self._restore(i, m), always_call=True
                )
            )
        return handles

    def arm(self, layer: int) -> None:
        """The session is about to run ``layer`` in a prefill: its attention call will be eager."""
        self._armed = layer

    def disarm(self) -> None:
        """The forward ended (also after an error): nothing stays armed or swapped."""
        self._armed = None
        for i in list(self._swapped):
            self._restore(i, self._attention[i])

    def _swap(self, layer: int, module: nn.Module) -> None:
        if self._armed != layer:
            return
        self._armed = None
        self._swapped[layer] = module.config
        # torch types a Module's attributes as Tensor | Module; this one is a config
        module.config = EagerConfigView(module.config)  # type: ignore[assignment]

    def _restore(self, layer: int, module: nn.Module) -> None:
        if layer in self._swapped:
            module.config = self._swapped.pop(layer)

    def eager_mask(self, layer: int, layout: VisionLayout, dtype: torch.dtype) -> torch.Tensor:
        """The additive float mask of an eager merge layer whose input is not compressed:
        causal, padding hidden (the first merge layer without `unmasked_first_merge`)."""
        mask = prefill_mask(layout.origin, layout.valid_mask, EAGER, dtype)
        assert mask is not None  # only sdpa and FlashAttention-2 masks may be None
        return mask

    def noncausal(self, layer: int) -> bool:
        """Whether ``layer`` is the first merge layer, which the released code runs without a
        causal mask (`prefill_mask`)."""
        return layer == self.first_merge

    def prefill_mask(
        self, layer: int, layout: VisionLayout, impl: str, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The mask of the first merge layer during prefill: in a row with vision tokens
        every real token attends to every real token of the row, padding hidden (a padding
        row attends to itself only, so its states stay finite); a row without vision tokens
        stays causal, as it is when it runs alone (no layout, nothing to merge), so a
        text-only row does not depend on the image rows batched with it. None for every
        other layer.

        Returns:
            ``[B, 1, N, N]`` (bool under sdpa, additive float under eager) or None. Under
            FlashAttention-2 the 2-D padding mask (None without padding): the layer then runs
            with the kernel's causal flag off (`noncausal`).

        Raises:
            NotImplementedError: under FlashAttention-2, a batch that mixes rows with and
                without vision tokens (the kernel's causal flag is one for the whole batch).
        """
        if layer != self.first_merge:
            return None
        valid = layout.valid_mask
        has_vision = layout.vision_mask.any(dim=1)  # [B]
        if impl == FLASH:
            real = valid.any(dim=1)
            if bool((real & ~has_vision).any()):
                raise NotImplementedError(
                    "unmasked_first_merge under FlashAttention-2 with a batch that mixes rows "
                    "with and without images: the kernel's causal flag is one for the whole "
                    "batch, and a text-only row must stay causal; batch text-only prompts "
                    "separately or load the model with attn_implementation='sdpa'"
                )
            return flash_mask(valid)
        allowed = valid.unsqueeze(1) & valid.unsqueeze(2)
        if not bool(has_vision.all()):
            origin = layout.origin
            causal = origin.unsqueeze(1) <= origin.unsqueeze(2)  # [B, Q, K]: key before query
            allowed &= causal | has_vision.view(-1, 1, 1)
        allowed |= torch.eye(valid.shape[1], dtype=torch.bool, device=valid.device)
        return finish_mask(allowed, impl, dtype)

    def positions(self, layout: VisionLayout, input_valid: torch.Tensor, full_pos, pos, pos_ids):
        """Position embeddings and ids of the compressed sequence after a stage: renumbered
        ``0 .. n-1`` in every row that has lost tokens so far, the original ones (as gathered
        by the session) in a row that has lost none, so a stage that removes nothing changes
        nothing (on Qwen2.5-VL renumbering would otherwise drop the 3-D positions).

        Args:
            layout: the compressed sequence.
            input_valid: ``[B]`` bool ``[B, N0]`` real tokens of the prompt.
            full_pos: the prompt's ``(cos, sin)`` (their dtype and device are used).
            pos: the survivors' original ``(cos, sin)``, ``[B, N', d]``.
            pos_ids: the survivors' original position ids (``[B, N']``, ``[k, B, N']`` for
                M-RoPE, or None).

        Returns:
            ``(pos, pos_ids)``, unchanged when positions are not renumbered.
        """
        if self._rotary is None or full_pos is None or pos is None:
            return pos, pos_ids
        valid = layout.valid_mask
        merged = valid.sum(dim=1) < input_valid.to(valid.device).sum(dim=1)  # [B]
        if not bool(merged.any()):
            return pos, pos_ids
        ids = renumbered_ids(valid)
        # the model's own rotary embedding: Qwen2.5-VL's broadcasts [B, N] to its three
        # M-RoPE axes, which is exactly the released code's 1-D renumbering
        new = self._rotary(full_pos[0], ids)
        rows = merged.view(-1, 1, 1)
        pos = tuple(torch.where(rows, n, o.expand_as(n)) for n, o in zip(new, pos))
        if pos_ids is not None:
            pos_ids = torch.where(
                merged.view(-1, 1), ids, pos_ids.expand(*pos_ids.shape[:-2], *ids.shape)
            )
        return pos, pos_ids
