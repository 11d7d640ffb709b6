"""LightKV's own methods: the ``lightkv*`` presets beside this file, and the two pieces of
``lightkv-cover`` that no other method uses.

LightKV itself (``lightkv``, ``lightkv-paper``, ``lightkv-budget``, ...) is a composition of
the generic policies (``grid`` windows, ``cosine`` divergence, the ``divergence`` pruner,
``relevance_mean`` messages, ``query_softmax`` relevance) and needs no code of its own.

**Relevance-coverage selection** (`RelevanceCoverage`): keep what the prompt points at, then
cover the rest of the image.

lightkv's own keep-set rule for low budgets (the ``lightkv-cover`` preset). It answers the
two ways a selection loses at 22% and 11% kept: dropping what the question asks about
(a prompt-blind selection can miss a small asked object) and dropping what nothing asks
about yet (a relevance ranking keeps a dozen near-identical tokens of the asked object and
loses a single-token glyph that a follow-up question needs). The first picks go by
relevance, the rest by coverage: farthest-point (max-min) selection, which DivPrune (Alvar
et al., CVPR 2025, arXiv:2503.02175) showed keeps rare tokens, started from the relevant
picks so it spends no budget on what they already cover. With a merging passer every token
it drops is merged into its most similar survivor (`lightkv.Stage`), so what coverage
leaves out still reaches the cache as part of a mean.

**`QuestionSimilarity`**: relevance as the cosine of each vision token to the question's
tokens.

The relevance a pre-LLM stage can afford at 7B width. `QuestionAttention` before the first
decoder layer projects layer 0's queries and keys of every token a second time (two
``N x D x D`` products, 2% of a 7B prefill at 3,000 tokens); this reads the hidden states
the stage already holds (before the LLM: the input embeddings, where projected image tokens
and text token embeddings share one space) and costs ``N x T x D`` for ``T`` question
tokens. It is CDPruner's instruction relevance (Zhang et al., NeurIPS 2025,
arXiv:2506.10967, Eq. 6; their ``llava_arch.py`` lines 155-160 at 9541616), without the
negation their CLIP space needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..graph.scatter import pack_rows, scatter_sum
from ..policies.counts import EPS, image_vision_counts, removal_count
from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, PruneInputs, Pruner, allocate_removals
from ..policies.relevance import Relevance, _accumulator

__all__ = ["RelevanceCoverage", "QuestionSimilarity"]


@Pruner.register("relevance_coverage")
@dataclass
class RelevanceCoverage(KeepSetPruner):
    """Keep ``ceil(share * k)`` tokens by relevance ξ, then ``k - ceil(share * k)`` by
    relevance-weighted farthest-point coverage (``k`` the window's kept count).

    1. **Relevant picks**: the window's ``ceil(share * k)`` tokens of highest ξ (ties: the
       earliest token).
    2. **Coverage picks**, one at a time: the token ``j`` maximising
       ``g_j * (ξ_j / max ξ)^power``, where ``g_j = min_{i in S} d(i, j)`` is its distance to
       the nearest kept token, ``d(i, j) = 1 - cos(x_i, x_j) + spatial * |p_i - p_j| / diag``
       (ties: the earliest). While nothing is kept
       yet (``share = 0``), ``g_j`` is the distance to ``j``'s nearest *other* token, as
       DivPrune's first pick.

    ``share = 0, power = 0, spatial = 0`` is DivPrune exactly; ``share = 1`` is a relevance
    top-k. ξ is the stage's relevance (`lightkv.policies.Relevance`: in the pre-LLM placement
    computed from decoder layer 0's own projections). A window whose ξ is constant (uniform
    relevance, or a prompt without a question) makes no relevance picks: every pick goes by
    coverage, so turning relevance off leaves coverage, not an arbitrary top-k.

    Attributes:
        share: fraction of each window's kept tokens chosen by relevance alone, in ``[0, 1]``.
        power: exponent of the normalised relevance in the coverage score (``>= 0``; 0:
            coverage alone).
        spatial: weight of the grid distance added to the cosine distance of two tokens
            (``>= 0``; the distance of their grid cells over the image's diagonal): two
            identical tokens far apart, two gems of one colour, count as different.
        features: ``hidden`` (the residual stream; before the LLM the input embeddings) or
            ``key_states`` (the layer's keys, heads concatenated).
        whole_image_spatial: ``spatial`` in a window that holds its whole image (None: the
            same). A budget-dependent layout (`lightkv.policies.GridPartitioner`'s
            ``min_kept_per_window``) makes an image one window when few tokens per window
            would remain; with so few picks, spreading them over the grid costs the rare
            tokens that feature distance alone keeps (``lightkv-cover``: 0).
    """

    share: float = 0.25
    power: float = 0.0
    spatial: float = 0.0
    features: Features = "hidden"
    whole_image_spatial: float | None = None

    def __post_init__(self) -> None:
        w = self.whole_image_spatial
        if w is not None and (
            isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < math.inf
        ):
            raise ValueError(
                f"relevance_coverage: whole_image_spatial must be None or a finite number >= 0, "
                f"got {w!r}"
            )
        for name, hi in (("share", 1.0), ("power", math.inf), ("spatial", math.inf)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0.0 <= value <= hi
                or value == math.inf
            ):
                bound = "in [0, 1]" if hi == 1.0 else "a finite number >= 0"
                raise ValueError(f"relevance_coverage: {name} must be {bound}, got {value!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` picks of window ``k`` (relevant, then covering).

        Windows of very different sizes (LLaVA-NeXT's 12 x 12 base windows beside its
        24 x 24 tile windows) run in groups of similar size, each padded to its own largest
        window: one ``[K, a_max, a_max]`` block would spend half its distances on padding.
        Windows are independent, so the picks are the same either way."""
        graph = inputs.graph
        groups = graph.window_groups(pairs="aa")
        if len(groups) == 1:
            return self._keep(inputs, count)
        kept = torch.zeros(graph.src_slots.shape, dtype=torch.bool, device=count.device)
        for g in groups:
            part = graph.select_windows(g)
            a = part.src_slots.shape[1]
            sub = PruneInputs(
                part,
                inputs.divergence[g, :a],
                inputs.relevance[g, :a],
                inputs.identity[g, :a],
                inputs.stage,
            )
            kept[g, :a] = self._keep(sub, count[g])
        return kept

    def _keep(self, inputs, count):
        graph = inputs.graph
        x = self.unit_features(inputs, self.stage_of(inputs, "relevance_coverage"), self.features)
        valid = graph.src_slots >= 0
        k, a = valid.shape
        kept = torch.zeros_like(valid)
        if k == 0 or int(count.max()) == 0:
            return kept
        xi = inputs.relevance.to(torch.float64).masked_fill(~valid, 0.0).clamp_min(0.0)
        top = xi.amax(dim=1, keepdim=True)
        q = torch.where(top > 0, xi / top.clamp_min(1e-300), torch.ones_like(xi))
        weight = q.pow(self.power) if self.power else torch.ones_like(q)

        # 1. the most relevant tokens (stable sort: ties go to the earlier token)
        n_rel = self.relevant_counts(xi, valid, count)
        # a window whose ξ says nothing (all equal: uniform relevance) is covered by coverage alone
        low = xi.masked_fill(~valid, math.inf).amin(dim=1)
        n_rel = torch.where(low < top.squeeze(1), n_rel, torch.zeros_like(n_rel))
        order = torch.sort((-xi).masked_fill(~valid, math.inf), dim=1, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(a, device=order.device).expand_as(order))
        kept = (rank < n_rel.unsqueeze(1)) & valid

        # 2. farthest-point coverage from the kept set
        # in the features' dtype (float32 at least, as DivPrune): a float64 copy of a
        # [K, a, a] block costs as much as the cosines at 7B width
        dist = 1.0 - x @ x.transpose(1, 2)  # [K, a, a]
        alone = self._whole_image_windows(inputs)  # [K] bool, or None: no window differs
        if alone is not None:
            weight = torch.where(alone, float(self.whole_image_spatial), float(self.spatial))
            dist = dist.add_(self._grid_distance(inputs, dist.dtype) * weight[:, None, None])
        elif self.spatial:
            dist = dist.add_(self._grid_distance(inputs, dist.dtype), alpha=self.spatial)
        pad_rows = ~valid.unsqueeze(2)
        seeded = kept.any(dim=1)
        gap = torch.full_like(dist[:, 0], math.inf)
        if bool(
            seeded.any()
        ):  # each [K, a, a] pass below costs a few ms at 7B width: only when needed
            to_kept = dist.masked_fill(~kept.unsqueeze(2) | pad_rows, math.inf).amin(dim=1)
            gap = torch.where(seeded.unsqueeze(1), to_kept, gap)
        if not bool(seeded.all()):
            self_or_pad = torch.eye(a, dtype=torch.bool, device=x.device) | pad_rows
            nearest_other = dist.masked_fill(self_or_pad, math.inf).amin(dim=1)
            gap = torch.where(seeded.unsqueeze(1), gap, nearest_other)
        windows = torch.arange(k, device=x.device)
        rest = count - n_rel
        for t in range(int(rest.max())):
            active = rest > t
            score = (
                gap if self.power == 0 else gap.clamp_max(2.0) * weight
            )  # inf: a window's lone token
            j = score.masked_fill(~valid | kept, -math.inf).argmax(dim=1)  # first maximum
            kept[windows, j] |= active
            picked = dist[windows, j]
            gap = torch.where(seeded.unsqueeze(1), torch.minimum(gap, picked), picked)
            seeded = seeded | active
        return kept

    def relevant_counts(
        self, xi: torch.Tensor, valid: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """``[K]`` int64 relevance picks per window: ``ceil(share * count)`` (ξ ``[K, a]``
        float64, ``valid [K, a]``; a subclass may make the share depend on ξ, as ``era``)."""
        return torch.minimum(
            torch.ceil(count.double() * self.share - 1e-9).long().clamp_min(0), count
        )

    def budget(self, graph, ratio):
        """``[K]``: the most a window may lose, ``min(ceil(ratio * n_w), |A_w|)`` (`removals`
        spreads each image's exact removals over its windows)."""
        ideal = graph.window_size.to(torch.float64) * torch.as_tensor(ratio, dtype=torch.float64)
        return torch.minimum(torch.ceil(ideal - EPS).long().clamp_min(0), graph.src_count)

    def removals(self, inputs, ratio):
        """``[K]`` int64 removals, exact per *image* whatever the windows: an image of ``n``
        tokens loses ``floor(ratio * n)`` (`lightkv.policies.counts.removal_count`), spread
        over its windows in proportion to their sizes by the largest remainder
        (`allocate_removals`), so 2 x 2 windows on a 16 x 16 grid keep 57 of 256 at 22%, as
        one window does, not 4 x 15. With one window per image this is `exact_removals`.
        """
        graph = inputs.graph
        if inputs.stage is None or graph.src_slots.shape[0] == 0:
            return super().removals(inputs, ratio)
        valid = graph.src_slots >= 0
        image = graph.token_blocks(inputs.stage.layout.image, "src").masked_fill(~valid, -1)
        group = torch.unique(image.amax(dim=1), return_inverse=True)[1]  # [K] the window's image
        groups = int(group.max()) + 1
        capacity = graph.src_count
        total = removal_count(scatter_sum(graph.window_size, group, groups), ratio)
        total = torch.minimum(total, scatter_sum(capacity, group, groups)).clamp_min(0)
        ideal = graph.window_size.to(torch.float64) * torch.as_tensor(ratio, dtype=torch.float64)
        return allocate_removals(ideal, capacity, group, total)

    def _whole_image_windows(self, inputs) -> torch.Tensor | None:
        """``[K]`` bool: the windows holding all of their image's current vision tokens;
        None where ``whole_image_spatial`` changes no window's weight."""
        whole = self.whole_image_spatial
        if whole is None or whole == self.spatial:
            return None
        graph, layout = inputs.graph, inputs.stage.layout
        valid = graph.src_slots >= 0
        image = graph.token_blocks(layout.image, "src").masked_fill(~valid, -1).amax(dim=1)
        alone = graph.window_size == image_vision_counts(layout)[image.clamp_min(0)]
        return alone if bool(alone.any()) else None

    @staticmethod
    def _grid_distance(inputs, dtype: torch.dtype) -> torch.Tensor:
        """``[K, a, a]`` Euclidean distance of two A tokens' grid cells divided by
        their image's grid diagonal (in ``[0, 1]``; tokens of two images of one window: 1)."""
        stage, graph = inputs.stage, inputs.graph
        layout = stage.layout
        coords = graph.token_blocks(layout.coords.to(dtype), "src")  # [K, a, 2]
        image = graph.token_blocks(layout.image, "src").clamp_min(0)  # [K, a]
        grid = layout.image_grid.to(dtype)
        diag = grid.pow(2).sum(-1).sqrt().clamp_min(1.0)[image]  # [K, a]
        d = torch.cdist(coords, coords) / diag.unsqueeze(2)
        return torch.where(
            image.unsqueeze(2) == image.unsqueeze(1), d.clamp_max(1.0), torch.ones_like(d)
        )


@Relevance.register("question_similarity")
@dataclass
class QuestionSimilarity(Relevance):
    """Mean cosine similarity of each vision token to the question's tokens, min-max scaled
    per row.

    For row ``b``, vision token ``i`` with hidden state ``x_i`` and question tokens ``t_m``
    (`Prompt.question_mask`: the text after the row's last vision token):

        r_i = mean_m cos(x_i, t_m),   ξ_i = (r_i - min r + floor) / (max r - min r + floor)

    (min and max over the row's vision tokens), so ξ lies in ``(0, 1]``: the most similar
    token 1, the least ``floor / (range + floor)``, never 0, so a weighted merge
    (``relevance_mean``) still counts every token. A row without question tokens, or whose
    ``r`` is constant, gets ξ = 1 on every vision token (uniform: a coverage pruner then
    picks by coverage alone). Zero outside vision tokens.

    The same as CDPruner's relevance: the mean over the instruction's tokens of the cosine
    in the LLM's input space and the per-row min-max scaling. Differs: no negation (theirs
    is specific to CLIP as LLaVA uses it, github.com/Theia-4869/CDPruner/issues/14), a
    floor of 1e-3 of the range instead of their 1e-6 added to the numerator only.

    Attributes:
        floor: what the least similar token keeps, as a share of the row's range (> 0).
    """

    query_rows = "none"
    key_cols = "none"
    reads_prompt: ClassVar[bool] = True
    reads_hidden: ClassVar[bool] = True
    floor: float = 1e-3

    def __post_init__(self) -> None:
        if (
            isinstance(self.floor, bool)
            or not isinstance(self.floor, (int, float))
            or not 0 < self.floor < float("inf")
        ):
            raise ValueError(
                f"question_similarity: floor must be a finite number > 0, got {self.floor!r}"
            )

    def score(self, queries, keys, layout, prompt=None, hidden=None):
        """``hidden [B, N, D]`` (the states the stage reads), ``prompt`` -> ``[B, N]``
        (``queries`` and ``keys`` are not read)."""
        if hidden is None or prompt is None:
            raise ValueError(
                "question_similarity needs the hidden states and the prompt's token ids: adapters "
                "pass both; in a direct call pass hidden=[B, N, D] and prompt=Prompt(input_ids)"
            )
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (layout.batch_size, layout.seq_len):
            raise ValueError(
                f"hidden {tuple(hidden.shape)} does not match the layout "
                f"[B={layout.batch_size}, N={layout.seq_len}, D]"
            )
        vision = layout.vision_mask
        question = prompt.question_mask(layout)
        x = torch.nn.functional.normalize(hidden.to(_accumulator(hidden)), dim=-1)
        # the question's tokens packed per row, [B, T, D]: a row's T x N products, never N x N
        pos, valid = pack_rows(question)
        t = x.gather(1, pos.unsqueeze(-1).expand(-1, -1, x.shape[-1])) * valid.unsqueeze(-1)
        count = valid.sum(1, keepdim=True)  # [B, 1]
        r = torch.einsum("bnd,btd->bn", x, t) / count.clamp_min(1)
        big = torch.finfo(r.dtype).max
        lo = torch.where(vision, r, big).amin(1, keepdim=True)
        hi = torch.where(vision, r, -big).amax(1, keepdim=True)
        span = hi - lo
        eps = torch.finfo(r.dtype).eps
        flat = (count == 0) | (span <= eps * hi.abs().clamp_min(1.0)) | ~vision.any(1, keepdim=True)
        floor = self.floor * span
        xi = (r - lo + floor) / (span + floor).clamp_min(torch.finfo(r.dtype).tiny)
        xi = torch.where(flat, torch.ones_like(xi), xi.clamp(0.0, 1.0))
        return torch.where(vision, xi, torch.zeros_like(xi))

    def hidden_flops(self, layout, hidden_size, prompt=None):
        """``2 N T D`` per row: every token's cosine to the row's ``T`` question tokens."""
        t = (
            int(prompt.question_mask(layout).sum(1).max())
            if prompt is not None and layout.batch_size
            else 0
        )
        return 2.0 * layout.batch_size * layout.seq_len * t * hidden_size
