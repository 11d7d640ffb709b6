"""DART: keep a few pivot tokens and the tokens least duplicated by them.

Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication
Matters More", EMNLP 2025 (arXiv:2502.11494); code github.com/ZichenWen1/DART (read from
its copy github.com/xqy1111111/DART at 5a19452, the authors' last commit there; the original
is not reachable here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner

__all__ = ["DART"]


@Pruner.register("dart")
@dataclass
class DART(KeepSetPruner):
    """Pivots by key norm, then per pivot the tokens least similar to it.

    The rule of the authors' LLaVA code (``llava/model/language_model/modeling_llama_self.py``,
    ``DART.get_retained_image_token``, lines 397-449 of xqy1111111/DART at 5a19452):

    * it runs before decoder layer ``K = 2`` on the output of layer 1 (``DART.forward``,
      the ``layer_idx == K`` branch): here a stage after 0-based layer 1 (the ``dart``
      preset's ``layers: [1]``);
    * pivots: the ``pivot_image_token = 4`` image tokens and ``pivot_text_token = 4``
      question tokens (everything after the image) with the largest L1 norm of the layer's
      keys, all heads concatenated (lines 419-428; defaults from ``llava/eval/*.py``); the
      image pivots are kept;
    * the pivots are visited in the iteration order of the Python set of their sequence
      positions (``for item in list(indices_set)``, line 433): CPython's order, which
      follows the positions' hashes (an int hashes to itself) modulo the set's table size,
      not the norms;
    * each pivot in turn takes the ``TOKEN_TOPK`` remaining image tokens with the *lowest*
      cosine similarity to it, which are kept and leave the candidates (lines 434-443; the
      cosine is of the final-normed hidden states, ``self.norm(last_layer_state)``);
    * ``TOKEN_TOPK = max_num_trunction // (pivots)`` (line 409: ``128 // 8 = 16``).

    The pivot order. ``pivot_order = "set"`` (default) visits the pivots as the code does:
    the iteration order of a Python set built from the image pivots' then the question
    pivots' positions (by decreasing norm), each position counted from the row's first
    valid token (the code's batch of one has no padding). It is an accident of hashing,
    reproduced because it changes the kept set (3 of 18 recorded cases equal with the
    fixed order); ``"norm"`` is lightkv's fixed order (image pivots, then question pivots,
    each by decreasing norm). ``docs/concepts/low-budget.md`` gives the measured effect.

    Here the kept count is each window's exact budget ``k`` (`exact_removals`), not
    ``4 + 8 * 16 = 132``: ``min(pivot_image_tokens, k)`` image pivots, and the other picks
    split evenly over the window's pivots, the first ``picks % pivots`` (in visiting order)
    taking one more; with ``k = 4 + 8 t`` every pivot takes ``t``, the code's
    ``TOKEN_TOPK`` for ``max_num_trunction = 8 t`` (the recorded fixtures).

    What differs: ties (norms, cosines) go to the earliest token; keys are lightkv's
    (before RoPE; the code's are after it, which changes their L1 norm); the cosine is of
    the residual stream (the code applies the final RMSNorm first: the same up to its
    per-channel weight); the question is the text after the row's last vision token (as
    `Prompt.question_mask`), and a row with fewer question tokens has fewer pivots; each
    image (window) is pruned on its own.

    Attributes:
        pivot_image_tokens: image pivots per window (kept; at least 1).
        pivot_text_tokens: question pivots per row (never removed: they are text).
        pivot_features: whose L1 norm picks the pivots: ``key_states`` (the code) or ``hidden``.
        features: the features of the cosine: ``hidden`` (the code) or ``key_states``.
        pivot_order: ``set`` (the code's: a Python set's iteration order) or ``norm``.
    """

    pivot_image_tokens: int = 4
    pivot_text_tokens: int = 4
    pivot_features: Features = "key_states"
    features: Features = "hidden"
    pivot_order: Literal["set", "norm"] = "set"

    def __post_init__(self) -> None:
        if self.pivot_order not in ("set", "norm"):
            raise ValueError(f"unknown pivot_order {self.pivot_order!r}; choose set or norm")
        # At least one image pivot: a window of an image without a question must still have
        # a pivot to keep its budget.
        for name, least in (("pivot_image_tokens", 1), ("pivot_text_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features, self.pivot_features}) - {"hidden"}

    @staticmethod
    def set_order(pos: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:
        """``[K, P]`` permutation of each window's pivots: the existing ones in the iteration
        order of ``set(their positions)`` (inserted in the given order), the others after."""
        perm = []
        for p, e in zip(pos.tolist(), exists.tolist()):
            items = [q for q, ok in zip(p, e) if ok]
            first = {q: i for i, (q, ok) in enumerate(zip(p, e)) if ok}
            order = [first[q] for q in set(items)]
            perm.append(order + [i for i in range(len(p)) if i not in order])
        return torch.tensor(perm, dtype=torch.long, device=pos.device).view(pos.shape)

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: each window's image pivots and its pivots' least similar
        tokens, ``count[k]`` in all."""
        graph = inputs.graph
        stage = self.stage_of(inputs, "dart")
        valid = graph.src_slots >= 0
        k, a = valid.shape
        if k == 0 or int(count.max()) == 0:
            return torch.zeros_like(valid)
        layout, dev = stage.layout, valid.device
        windows = torch.arange(k, device=dev)
        feats = stage.features(self.features)
        x = self.unit_features(inputs, stage, self.features)  # [K, a, F]
        piv = stage.features(self.pivot_features)
        norm = (
            piv.reshape(*piv.shape[:2], -1)
            .to(torch.promote_types(piv.dtype, torch.float32))
            .abs()
            .sum(-1)
        )  # [B, N] L1

        # Image pivots: the largest norms of the window (stable sort: ties to the earliest).
        n_img = torch.minimum(count, torch.full_like(count, self.pivot_image_tokens))
        img_norm = graph.token_blocks(norm, "src").masked_fill(~valid, -math.inf)
        img_order = torch.sort(img_norm, dim=1, descending=True, stable=True).indices[
            :, : self.pivot_image_tokens
        ]
        img_exists = torch.arange(img_order.shape[1], device=dev) < n_img.unsqueeze(1)  # [K, p_i]
        kept = torch.zeros_like(valid)
        kept[windows.unsqueeze(1).expand_as(img_order)[img_exists], img_order[img_exists]] = True
        img_vec = x[windows.unsqueeze(1), img_order]  # [K, p_i, F]

        # Question pivots: per row, the largest norms among the text after the last vision token.
        pos = torch.arange(layout.seq_len, device=dev).expand(layout.batch_size, -1)
        last = torch.where(layout.vision_mask, pos, torch.full_like(pos, -1)).amax(1, keepdim=True)
        question = layout.text_mask & (pos > last)
        txt_order = torch.sort(
            norm.masked_fill(~question, -math.inf), dim=1, descending=True, stable=True
        ).indices
        txt_order = txt_order[:, : self.pivot_text_tokens]  # [B, p_t]
        txt_exists = torch.arange(txt_order.shape[1], device=dev) < question.sum(1, keepdim=True)
        row = torch.zeros(k, dtype=torch.long, device=dev).scatter_(
            0, graph.node_window, graph.node_row
        )
        txt_vec = self.unit_rows(feats[row.unsqueeze(1), txt_order[row]])  # [K, p_t, F]

        vec = torch.cat([img_vec, txt_vec], dim=1)  # [K, P, F], image pivots first
        exists = torch.cat([img_exists, txt_exists[row]], dim=1)  # [K, P]
        if self.pivot_order == "set":
            # positions in the unpadded row: what the code's set holds
            at = layout.valid_mask.long().cumsum(1) - 1  # [B, N]
            img_pos = graph.node_pos[graph.src_slots.gather(1, img_order).clamp_min(0)]
            pos = torch.cat(
                [at[row.unsqueeze(1), img_pos], at[row.unsqueeze(1), txt_order[row]]], 1
            )
            perm = self.set_order(pos, exists)
            vec, exists = vec[windows.unsqueeze(1), perm], exists.gather(1, perm)
        picks = count - n_img
        pivots = exists.sum(1).clamp_min(1)
        rank = exists.long().cumsum(1) - 1
        quota = (picks // pivots).unsqueeze(1) + (rank < (picks % pivots).unsqueeze(1)).long()
        quota = quota.masked_fill(~exists, 0)  # [K, P]
        for p in range(vec.shape[1]):
            free = valid & ~kept
            cos = torch.einsum("kaf,kf->ka", x, vec[:, p]).masked_fill(~free, math.inf)
            order = torch.sort(cos, dim=1, stable=True).indices  # least similar first
            slot_rank = torch.empty_like(order)
            slot_rank.scatter_(1, order, torch.arange(a, device=dev).expand_as(order))
            kept |= free & (slot_rank < quota[:, p].unsqueeze(1))
        return kept
