"""The released code's model-level quirks inside a session (`lightkv.quirks.ReleasedQuirks`):
positions renumbered after a merge, and the first merge layer without a causal mask.

Internals of `lightkv.adapters.session`; a no-op unless a quirk is on. Both act during
prefill only: decoding keeps the model's own positions (the original prompt length
onwards) and causal masks, as the released code does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..graph.layout import VisionLayout
from ..pipeline import Stage
from ..quirks import RELEASED_FAMILIES, ReleasedQuirks
from .base import Adapter
from .masks import FLASH, finish_mask, flash_mask

__all__ = ["ReleasedQuirksHook", "renumbered_ids"]


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
                f"released_quirks ({on}) apply to merges after a decoder layer; the released code has no pre-LLM "
                "or cache stages: turn the quirks off or use a schedule of decoder layers"
            )
        if (
            quirks.unmasked_first_merge
        ):  # a stage of ratio 0 merges nothing: the quirks then change nothing
            self.first_merge = min(
                (s.spec.layer for s in stages if s.spec.removal_ratio > 0), default=None
            )
        if quirks.renumber_positions:
            self._rotary = getattr(language_model, "rotary_emb", None)
            if not callable(self._rotary):
                raise NotImplementedError(
                    f"renumber_positions needs the decoder's rotary embedding ({type(language_model).__name__}"
                    ".rotary_emb); turn the quirk off"
                )

    def noncausal(self, layer: int) -> bool:
        """Whether ``layer`` is the first merge layer, which the released code runs without a
        causal mask (`prefill_mask`)."""
        return layer == self.first_merge

    def prefill_mask(
        self, layer: int, layout: VisionLayout, impl: str, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The mask of the first merge layer during prefill: every real token attends to
        every real token of its row, padding hidden (a padding row attends to itself only,
        so its states stay finite). None for every other layer.

        Returns:
            ``[B, 1, N, N]`` (bool under sdpa, additive float under eager) or None. Under
            FlashAttention-2 the 2-D padding mask (None without padding): the layer then runs
            with the kernel's causal flag off (`noncausal`).
        """
        if layer != self.first_merge:
            return None
        valid = layout.valid_mask
        if impl == FLASH:
            return flash_mask(valid)
        allowed = valid.unsqueeze(1) & valid.unsqueeze(2)
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
