"""CDPruner: keep the tokens of maximal conditional diversity (a DPP conditioned on the
instruction), by greedy MAP inference.

Zhang et al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token
Pruning in MLLMs", NeurIPS 2025 (arXiv:2506.10967); code github.com/Theia-4869/CDPruner.
Greedy MAP with the incremental Cholesky update: Chen, Zhang, Zhou, "Fast Greedy MAP
Inference for Determinantal Point Process to Improve Recommendation Diversity", NeurIPS
2018 (arXiv:1709.05135), Algorithm 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..policies.inputs import Features, StageInputs
from ..policies.pruners import KeepSetPruner, PruneInputs, Pruner

__all__ = ["CDPruner"]


@Pruner.register("cdpruner")
@dataclass
class CDPruner(KeepSetPruner):
    """Greedy MAP of the DPP with kernel ``L = diag(q) S diag(q)`` in each window.

    The rule of the authors' code (``llava/model/llava_arch.py``, ``encode_images``, lines
    141-183 of github.com/Theia-4869/CDPruner at 9541616):

    * ``S``: cosine similarity of the vision tokens' features (lines 151-153; there the
      projected image features, i.e. the LLM's input embeddings);
    * relevance: ``r_i = mean_m cos(x_i, t_m)`` over the instruction embeddings ``t_m``
      (line 158), negated (line 159), then min-max normalised,
      ``q_i = (r_i - min r + 1e-6) / (max r - min r)`` (line 160);
    * optionally ``q = exp(alpha q)`` with ``alpha = theta / (2 (1 - theta))`` (lines
      163-166, commented out in the code, the paper's trade-off);
    * greedy MAP (lines 170-181): ``d_i^2 = L_ii``; each step picks ``j = argmax d^2``
      (ties: the earliest), ``e = (L_j - c_j^T C) / d_j``, appends ``e`` to ``C`` and sets
      ``d^2 -= e^2``: each pick maximises ``det(L_S)`` given the picks before it.

    The instruction. In the LLaVA code ``t`` is CLIP's text embedding of the question and
    ``x`` CLIP's projected image embeddings; here both are the stage's hidden states (in the
    pre-LLM mode, the LLM's input embeddings, where projected image tokens and text token
    embeddings share one space): ``t_m`` are the question tokens
    (``stage.prompt.question_mask(layout)``, the text after the row's last vision token),
    so the mean runs over the question's tokens. Where the stage has no prompt, or a row
    has no question tokens, that row's relevance is uniform (``q = 1``: plain DPP of ``S``)
    instead of an error; also a window whose relevance is constant.

    The sign. The code negates the cosine before the normalisation (line 159), so tokens
    *farther* from the question weigh more in the kernel; its authors say they saw this
    property in CLIP as LLaVA uses it (github.com/Theia-4869/CDPruner/issues/14). It is the
    default here (``negate = True``), so the ``cdpruner`` preset keeps the authors' tokens
    (recorded fixtures, ``tests/methods``); ``negate = False`` is lightkv's variant, the
    ``cdpruner-pos`` preset (tokens closer to the question weigh more).

    What else differs: the minimum and maximum are a window's (one image with the ``global``
    partitioner), not the whole batch's (the code's batch is one image's crops); once the
    DPP is exhausted (every remaining gain ``d^2`` below ``64 eps max L_ii``: the features
    span no new direction, e.g. duplicates or more picks than feature dimensions) the
    remaining picks go by ``q`` (ties: the earliest) instead of dividing by a vanishing
    ``d_j``; the kept count is `exact_removals`' rather than a fixed token number. ``S`` is
    computed in float32 at least, the greedy in float64.

    Attributes:
        features: the features of ``S``: ``hidden`` (default) or ``key_states``. Relevance always
            reads the hidden states (the question's keys are not in the vision tokens' space).
        negate: negate the relevance cosine, as the authors' code does (default); False:
            the ``cdpruner-pos`` variant.
        theta: None: ``q`` is the normalised relevance (the code's default); a number in
            ``[0, 1)``: ``q = exp(theta / (2 (1 - theta)) * q)`` (0 gives uniform ``q``).
    """

    reads_prompt: ClassVar[bool] = True
    """Reads ``StageInputs.prompt`` (its question tokens): a host that cannot give the
    prompt to the stage (vLLM's embedding step) refuses this pruner rather than run it blind."""

    features: Features = "hidden"
    negate: bool = True
    theta: float | None = None

    def __post_init__(self) -> None:
        if self.theta is not None and (
            isinstance(self.theta, bool)
            or not isinstance(self.theta, (int, float))
            or not 0.0 <= self.theta < 1.0
        ):
            raise ValueError(f"theta must be None or in [0, 1), got {self.theta!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def quality(self, inputs: PruneInputs, stage: StageInputs) -> torch.Tensor:
        """``[K, a_max]`` float64 ``q`` per A slot (1 on padding, where there is no question
        and in a one-token window; with ``theta``, ``exp(alpha q)`` of that)."""
        graph = inputs.graph
        valid = graph.src_slots >= 0
        ones = torch.ones(valid.shape, dtype=torch.float64, device=valid.device)
        if stage.prompt is None or stage.hidden is None or valid.numel() == 0:
            return ones
        h = stage.hidden.to(torch.promote_types(stage.hidden.dtype, torch.float32))
        h = h / h.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
        question = stage.prompt.question_mask(stage.layout).to(h.device)  # [B, N]
        count = question.sum(1)  # [B]
        # mean_m cos(x, t_m) = x . mean_m t_m for unit vectors: one matrix product per row.
        t = (h * question.unsqueeze(-1)).sum(1) / count.clamp_min(1).unsqueeze(-1).to(h.dtype)
        x = graph.token_blocks(h, "src")  # [K, a_max, D] unit vision tokens
        row = graph.node_row[graph.src_slots.clamp_min(0)]  # [K, a_max]
        r = torch.einsum("kad,kad->ka", x, t[row]).to(torch.float64)
        if self.negate:
            r = -r
        lo = r.masked_fill(~valid, math.inf).amin(1, keepdim=True)
        hi = r.masked_fill(~valid, -math.inf).amax(1, keepdim=True)
        spread = hi - lo
        q = (r - lo + 1e-6) / spread.clamp_min(torch.finfo(torch.float64).tiny)
        usable = (count[row] > 0) & (spread > 0)
        q = torch.where(usable & valid, q, ones)
        if self.theta is not None:
            q = torch.exp(self.theta / (2.0 * (1.0 - self.theta)) * q)
        return q

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` greedy MAP picks of window ``k``."""
        graph = inputs.graph
        stage = self.stage_of(inputs, "cdpruner")
        valid = graph.src_slots >= 0
        k, a = valid.shape
        kept = torch.zeros_like(valid)
        steps = int(count.max()) if k else 0
        if steps == 0:
            return kept
        x = self.unit_features(inputs, stage, self.features)
        q = self.quality(inputs, stage)
        sim = (x @ x.transpose(1, 2)).to(torch.float64)
        # cos(x, x) = 1 exactly: with uniform q the first pick is a true tie (the earliest
        # token), not decided by the rounding of |x|^2.
        sim.diagonal(dim1=1, dim2=2).copy_(valid.to(torch.float64))
        kernel = q.unsqueeze(2) * sim * q.unsqueeze(1)  # [K, a, a]
        gain = torch.diagonal(kernel, dim1=1, dim2=2).clone()  # d_i^2
        tol = 64 * torch.finfo(x.dtype).eps * gain.masked_fill(~valid, 0).amax(1)  # [K]
        chol = torch.zeros(steps, k, a, dtype=torch.float64, device=x.device)  # rows of C
        windows = torch.arange(k, device=x.device)
        for t in range(steps):
            active = count > t
            free = valid & ~kept
            gm = gain.masked_fill(~free, -math.inf)
            exhausted = gm.amax(dim=1) <= tol
            # A spent DPP: every free token's gain is numerical noise; take q's order instead.
            j = torch.where(
                exhausted, q.masked_fill(~free, -math.inf).argmax(dim=1), gm.argmax(dim=1)
            )
            grow = active & ~exhausted
            dj = gain[windows, j].clamp_min(torch.finfo(torch.float64).tiny).sqrt()
            e = (
                kernel[windows, j] - torch.einsum("tk,tka->ka", chol[:t, windows, j], chol[:t])
            ) / dj.unsqueeze(1)
            e = torch.where(grow.unsqueeze(1), e, torch.zeros_like(e))
            chol[t] = e
            gain = gain - e * e
            kept[windows, j] |= active
        return kept
