"""EADP: entropy-aware dense instruction relevance, then relevance-weighted facility location.

"Combating Textual Noise and Redundancy: Entropy-Aware Dense Visual Token Pruning", ECCV
2026; code github.com/SJTU-DeepVisionLab/EADP (``LLaVA/llava/model/llava_arch.py`` at
e1a0880). Also holds the weighted facility-location greedy that the ``tops`` preset reuses
(`facility_location`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..graph.scatter import pack_rows
from ..policies.inputs import Features, StageInputs
from ..policies.pruners import KeepSetPruner, PruneInputs, Pruner

__all__ = ["EADP", "QUESTION_CHUNK", "facility_location", "question_tokens"]

QUESTION_CHUNK = 256
"""Question tokens scored against a window's image tokens at once (memory ``K a 256``)."""


def question_tokens(stage: StageInputs, graph) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [K, a, D], t [K, T, D], t_valid [K, T])``: each window's vision tokens and its
    row's question tokens (`Prompt.question_mask`; none without a prompt), both
    L2-normalised, float32 at least.

    Raises:
        ValueError: the stage has no hidden states.
    """
    if stage.hidden is None:
        raise ValueError(
            "this pruner reads the question's tokens: the stage needs its hidden states (a "
            "stage before the LLM or after a layer; adapters pass them)"
        )
    h = stage.hidden.to(torch.promote_types(stage.hidden.dtype, torch.float32))
    h = h / h.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(h.dtype).tiny)
    if stage.prompt is None:  # no question: no question tokens (uniform relevance, as CDPruner)
        question = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
    else:
        question = stage.prompt.question_mask(stage.layout).to(h.device)
    pos, valid = pack_rows(question)  # [B, T]
    t = h.gather(1, pos.unsqueeze(-1).expand(-1, -1, h.shape[-1])) * valid.unsqueeze(-1)
    row = graph.node_row[graph.src_slots.clamp_min(0)[:, 0]]  # [K] each window's batch row
    return graph.token_blocks(h, "src"), t[row], valid[row]


def facility_location(
    sim: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """``[K, a]`` bool: ``count[k]`` greedy picks of the weighted facility location
    ``F(S) = sum_i w_i max_{s in S} sim(s, i)`` in each window.

    Each step keeps the unkept valid token ``j`` of largest gain
    ``sum_i w_i (max(sim(j, i), c_i) - c_i)`` with ``c_i`` the coverage so far (0 at first;
    ties: the earliest token).

    Args:
        sim: ``[K, a, a]`` similarities, row = candidate, column = covered token (``>= 0``).
        weight: ``[K, a]`` ``w_i`` of each covered token (0 on padding).
        valid: ``[K, a]`` bool, the window's real slots.
        count: ``[K]`` int64 picks per window.
    """
    k, a = valid.shape
    kept = torch.zeros_like(valid)
    cover = sim.new_zeros(k, a)
    windows = torch.arange(k, device=sim.device)
    for t in range(int(count.max()) if k else 0):
        active = count > t
        c = cover.unsqueeze(1)
        gain = ((torch.maximum(sim, c) - c) * weight.unsqueeze(1)).sum(dim=2)  # [K, a]
        j = gain.masked_fill(~valid | kept, -math.inf).argmax(dim=1)  # first maximum
        kept[windows, j] |= active
        cover = torch.maximum(cover, sim[windows, j])
    return kept


@Pruner.register("eadp")
@dataclass
class EADP(KeepSetPruner):
    """Entropy-aware dense relevance ``w``, then ``count`` greedy picks of the facility
    location ``sum_i w_i max_{s in S} sim(s, i)`` in each window (`facility_location`).

    The rule of the authors' code (``LLaVA/llava/model/llava_arch.py`` of
    github.com/SJTU-DeepVisionLab/EADP at e1a0880, ``encode_images`` lines 513-635 and the
    methods it calls), with ``x_i`` the unit vision tokens and ``t_m`` the unit question
    tokens:

    * ``sim(i, j) = (cos(x_i, x_j) + 1) / 2``, cosine clamped to ``[-1, 1]``
      (``sim_visual``);
    * global and dense relevance, both negated as in the code (as CDPruner's):
      ``g_i = -cos(x_i, t_g)`` and ``l_im = -cos(x_i, t_m)`` (``sim_cross``);
    * entropy filter (``entrpy_filter``): ``H_m`` is the entropy of
      ``softmax_i(temperature * l_im)`` over the window's tokens; the
      ``max(1, floor(text_keep * T))`` question tokens of lowest ``H`` stay;
    * local aggregation (``negative_entropy``): ``l_i = sum_m softmax_m(-H_m / (tau +
      1e-6)) l_im`` over the tokens that stay;
    * fusion ``r = alpha g + (1 - alpha) l``, min-max normalised per window,
      ``(r - min + 1e-6) / (max - min + 1e-6)``; a 3 x 3 Gaussian (sigma 1, reflect padding)
      on the image's grid (``spatial_smoothing``); then ``w = r ** beta``;
    * greedy facility location (``greed_select``), ties to the earliest token.

    What differs: the text is the LLM's input embeddings of the question tokens, not CLIP's
    text tower (which the code pads to 77 positions, so its dense tokens include BOS, EOS and
    padding), and the global text ``t_g`` is the normalised mean of the unit question tokens,
    not CLIP's pooled EOS embedding; the image side is the same hidden states, not CLIP's
    projected image embeddings. The grid is the image's own (any shape; the code smooths
    only 24 x 24 blocks or a square). A row without question tokens gets ``w = 1`` (plain
    facility location), as does a stage without the prompt. The kept count is lightkv's
    exact budget; LLaVA-NeXT's per-crop budget allocation (``strategy_importance_allocation``)
    is not reproduced: each window (one image with the ``global`` partitioner) keeps its
    exact share.

    Attributes:
        alpha: weight of the global relevance (the code's 0.5).
        beta: exponent of the relevance (the code's 1.0 for LLaVA, 2.0 for LLaVA-Video).
        text_keep: share of question tokens kept by the entropy filter (the code's 0.2).
        temperature: the entropy filter's softmax temperature (the code's 100).
        tau: the aggregation temperature ``M_temp`` (the code's 0.01).
        smooth: apply the 3 x 3 Gaussian on the grid (the code does).
        negate: negate the cosines, as the code does (default; False: tokens closer to the
            question weigh more, the sign ``cdpruner-pos`` takes for CDPruner).
        features: the features of ``sim``: ``hidden`` or ``key_states``.
    """

    reads_prompt: ClassVar[bool] = True
    """Reads the question's tokens: a host without the prompt refuses the preset."""

    alpha: float = 0.5
    beta: float = 1.0
    text_keep: float = 0.2
    temperature: float = 100.0
    tau: float = 0.01
    smooth: bool = True
    negate: bool = True
    features: Features = "hidden"

    def __post_init__(self) -> None:
        bounds = {"alpha": (0.0, 1.0), "text_keep": (0.0, 1.0), "beta": (0.0, math.inf)}
        bounds |= {"temperature": (0.0, math.inf), "tau": (0.0, math.inf)}
        for name, (lo, hi) in bounds.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"eadp: {name} must be a number in [{lo}, {hi}], got {v!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def weights(self, inputs: PruneInputs, stage: StageInputs) -> torch.Tensor:
        """``[K, a]`` the relevance ``w`` of each A slot (0 on padding)."""
        graph = inputs.graph
        valid = graph.src_slots >= 0
        x, t, t_valid = question_tokens(stage, graph)
        n_q = t_valid.sum(1)  # [K]
        g = t.sum(1) / n_q.clamp_min(1).unsqueeze(1).to(t.dtype)
        g = g / g.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
        sign = -1.0 if self.negate else 1.0
        glob = sign * torch.einsum("kad,kd->ka", x, g)

        def local(c: slice) -> torch.Tensor:  # [K, a, |c|]: question tokens c only
            return sign * torch.einsum("kad,ktd->kat", x, t[:, c])

        # a long prompt's question is read QUESTION_CHUNK tokens at a time: never [K, a, T]
        chunks = [slice(i, i + QUESTION_CHUNK) for i in range(0, t.shape[1], QUESTION_CHUNK)]
        ents = []
        for c in chunks:
            logits = (local(c) * self.temperature).masked_fill(~valid.unsqueeze(2), -math.inf)
            p = torch.softmax(logits, dim=1)
            ents.append(-(p * torch.log(p + 1e-12)).sum(dim=1))
        # padded question slots rank last (+inf)
        ent = torch.cat(ents, 1) if ents else glob.new_zeros(glob.shape[0], 0)
        ent = ent.masked_fill(~t_valid, math.inf)  # [K, T]
        n_keep = (n_q.double() * self.text_keep).floor().long().clamp_min(1)
        order = torch.sort(ent, dim=1, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
        )
        stay = (rank < n_keep.unsqueeze(1)) & t_valid
        mix = torch.softmax((-ent / (self.tau + 1e-6)).masked_fill(~stay, -math.inf), dim=1)
        mix = mix.nan_to_num(0.0)
        loc = glob.new_zeros(glob.shape)
        for c in chunks:  # a second pass: the weights need every chunk's entropy first
            loc = loc + (mix[:, c].unsqueeze(1) * local(c)).sum(dim=2)
        r = self.alpha * glob + (1 - self.alpha) * loc
        lo = r.masked_fill(~valid, math.inf).amin(1, keepdim=True)
        hi = r.masked_fill(~valid, -math.inf).amax(1, keepdim=True)
        w = (r - lo + 1e-6) / (hi - lo + 1e-6)
        w = torch.where((n_q > 0).unsqueeze(1), w, torch.ones_like(w))
        if self.smooth:
            w = self._smooth(w, graph, stage)
        return (w**self.beta).masked_fill(~valid, 0.0)

    @staticmethod
    def _smooth(w: torch.Tensor, graph, stage: StageInputs) -> torch.Tensor:
        """A 3 x 3 Gaussian (sigma 1, reflect padding) of each window's ``w`` on its image's
        grid; windows that are not one whole image of at least 2 x 2 are left as they are."""
        layout = stage.layout
        coords = graph.token_blocks(layout.coords, "src")  # [K, a, 2]
        image = graph.token_blocks(layout.image, "src")  # [K, a]
        valid = graph.src_slots >= 0
        offset = torch.arange(3, dtype=w.dtype, device=w.device) - 1
        radius = (offset.view(3, 1) ** 2 + offset.view(1, 3) ** 2).sqrt()
        kernel = torch.exp(-(radius**2) / 2.0)
        kernel = (kernel / kernel.sum()).view(1, 1, 3, 3)
        out = w.clone()
        for k in range(w.shape[0]):
            m = valid[k]
            img = image[k][m]
            if img.numel() == 0 or bool((img != img[0]).any()):
                continue
            h, wd = (int(v) for v in layout.image_grid[int(img[0])])
            if h < 2 or wd < 2 or int(m.sum()) != h * wd:
                continue
            rc = coords[k][m]
            grid = w.new_zeros(h, wd)
            grid[rc[:, 0], rc[:, 1]] = w[k][m]
            padded = torch.nn.functional.pad(grid.view(1, 1, h, wd), (1, 1, 1, 1), mode="reflect")
            out[k, m] = torch.nn.functional.conv2d(padded, kernel)[0, 0][rc[:, 0], rc[:, 1]]
        return out

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` greedy facility-location picks of window ``k``."""
        graph = inputs.graph
        stage = self.stage_of(inputs, "eadp")
        valid = graph.src_slots >= 0
        if valid.shape[0] == 0 or int(count.max()) == 0:
            return torch.zeros_like(valid)
        x = self.unit_features(inputs, stage, self.features)
        sim = 0.5 * ((x @ x.transpose(1, 2)).clamp(-1.0, 1.0) + 1.0)
        return facility_location(sim, self.weights(inputs, stage).to(sim.dtype), valid, count)
