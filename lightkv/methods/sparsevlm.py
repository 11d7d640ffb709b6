"""SparseVLM: text raters rank the vision tokens inside the LLM, at a few layers; each stage
keeps the top tokens and recycles the best of the pruned ones into a few cluster tokens.

Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model
Inference", ICML 2025 (arXiv:2410.04417); code github.com/Gumpest/SparseVLMs (version 1.0,
the default ``USE_VERSION``: ``llava/model/language_model/modelling_sparse_llama.py``,
``score.py`` and ``utils.py``, read at 26a5f48).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..policies.counts import image_vision_counts, kept_count
from ..policies.partitioners import Partition, Partitioner
from ..policies.passers import MessagePasser
from ..policies.pruners.all_sources import AllSources
from ..policies.pruners.base import Pruner
from ..policies.relevance import Relevance, attention_from_rows

__all__ = ["PlainMean", "RaterAttention", "RecycleAll", "SparseVLMSplit", "dpc_knn", "raters"]


def raters(vision: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: SparseVLM's text raters among the question's tokens ``text [T, D]``
    given the image tokens ``vision [V, D]``: ``m = mean_v softmax_t(v . t)``, raters
    ``m > mean(m)`` (``modelling_sparse_llama.py``, lines 199-204)."""
    m = (vision.float() @ text.float().T).softmax(dim=1).mean(0)
    return m > m.mean()


@Relevance.register("rater_attention")
@dataclass
class RaterAttention(Relevance):
    """The attention SparseVLM's text raters pay each vision token: the layer's attention
    probabilities (causal softmax over the keys) averaged over heads and over the raters
    (``score.py``, ``attn_postprocess_topk``: ``attn.mean(1)``, the raters' rows, ``.mean(1)``).

    The raters are chosen by `raters` from ``hidden`` (the stage layer's input hidden
    states; the code chooses them once, from the input embeddings) among the question's
    tokens (the text after the row's last vision token; the code: every token after the
    image). A row without a rater reads its whole question.
    """

    query_rows = "all"
    key_cols = "all"
    reads_prompt: ClassVar[bool] = True
    reads_hidden: ClassVar[bool] = True

    def score(self, queries, keys, layout, prompt=None, hidden=None):
        """``queries [B, H, N, d]``, ``keys [B, H_kv, N, d]``, the prompt and ``hidden
        [B, N, D]`` -> ``[B, N]``."""
        self._check(queries, keys, layout)
        if prompt is None or hidden is None:
            raise ValueError(
                "rater_attention needs the prompt's token ids and the layer's hidden states: "
                "pass prompt=Prompt(input_ids) and hidden=[B, N, D]"
            )
        question = prompt.question_mask(layout)
        rows = torch.zeros_like(question)
        for b in range(layout.batch_size):
            q = torch.nonzero(question[b]).flatten()
            v = layout.vision_mask[b]
            if q.numel() and bool(v.any()):
                rows[b, q[raters(hidden[b, v], hidden[b, q])]] = True
        rows = torch.where(rows.any(1, keepdim=True), rows, question)
        xi = attention_from_rows(queries, keys, layout, rows, "mean", causal=True)
        return xi / rows.sum(1, keepdim=True).clamp_min(1).to(xi.dtype)


def dpc_knn(x: torch.Tensor, clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseVLM's recycling clusters (``utils.py``, ``cluster_and_merge``: DPC-KNN) of the
    tokens ``x [m, C]``: ``(centers [clusters], assign [m])``, ``assign`` the index of each
    token's center in ``centers`` (a center is its own).

    Distances ``|x_i - x_j| / sqrt(C)``; density ``exp(-mean d^2)`` over each token's
    ``clusters`` nearest (itself included); a token's parent distance is its distance to the
    nearest token of higher density (the largest distance where none); centers are the
    ``clusters`` largest ``distance x density``; every token goes to its nearest center
    (ties: the first center). The code adds ``rand * 1e-6`` to the densities against ties;
    here there is no noise."""
    x = x.to(torch.float32)
    dist = torch.cdist(x, x) / math.sqrt(x.shape[-1])
    near = torch.topk(dist, k=clusters, dim=-1, largest=False).values
    density = torch.exp(-(near**2).mean(-1))
    higher = density.unsqueeze(0) > density.unsqueeze(1)  # [i, j]: j denser than i
    parent = torch.where(higher, dist, dist.max()).amin(-1)
    centers = torch.topk(parent * density, k=clusters).indices
    assign = dist[centers].argmin(0)
    assign[centers] = torch.arange(clusters, device=x.device)
    return centers, assign


def recycled(pruned: int) -> tuple[int, int]:
    """``(recycled, clusters)`` of a stage that prunes ``pruned`` tokens: the top 30% (plus
    one) are clustered into ``int(recycled / 10) + 1`` tokens (lines 282-286)."""
    r = min(int(pruned * 0.3) + 1, pruned)
    return r, (int(r / 10) + 1 if r else 0)


@Partitioner.register("sparsevlm")
@dataclass
class SparseVLMSplit(Partitioner):
    """One SparseVLM stage per image: the ``k_top`` tokens of highest relevance (the raters'
    attention, `RaterAttention`) stay, the top 30% (plus one) of the others by relevance
    are clustered (`dpc_knn` on the stage's hidden states) and each cluster merged into its
    center, and the rest leave.

    The count. The code keeps a fixed ``k_top`` per layer (``score.py``: 66, 30 and 17 at
    layers 2, 6 and 15 for its 64-token setting) and adds its clusters. Here a stage keeps
    ``k = n - floor(P n)`` tokens in all, clusters included: ``k_top`` is the largest with
    ``k_top + clusters(n - k_top) = k`` (the presets' ratios are the code's totals, so
    ``k_top`` is the code's). An image keeps at most ``n - 1`` by relevance, as the code's
    ``min(k_top, n - 1)``.
    """

    def partition(self, inputs):
        layout = inputs.layout
        vision = layout.vision_mask
        if not bool(vision.any()):
            return Partition.empty(layout)
        if inputs.relevance is None or inputs.hidden is None:
            raise ValueError(
                "the sparsevlm partitioner ranks by the raters' attention: give the stage a "
                "relevance (rater_attention) and hidden states"
            )
        img = layout.image[vision]
        xi = inputs.relevance[vision].to(torch.float64)
        x = inputs.hidden[vision]
        n_img = image_vision_counts(layout)
        budget = kept_count(n_img, inputs.spec.removal_ratio)
        window = torch.full_like(img, -1)
        is_src = torch.zeros_like(img, dtype=torch.bool)
        next_window = 0
        for i in range(layout.num_images):
            where = torch.nonzero(img == i).flatten()
            n, k = where.numel(), int(budget[i])
            if n == 0 or k >= n:
                continue
            top = self.top_count(n, k)
            order = where[torch.sort(-xi[where], stable=True).indices]
            pruned = order[top:]
            r, c = recycled(pruned.numel())
            pool, leave = pruned[:r], pruned[r:]
            if leave.numel():  # a window without a target: its tokens leave unmerged
                window[leave], is_src[leave] = next_window, True
                next_window += 1
            if c:
                centers, assign = dpc_knn(x[pool], c)
                window[pool] = next_window + assign
                is_src[pool] = True
                is_src[pool[centers]] = False
                next_window += c
        part = Partition.empty(layout)
        part.window[vision] = window
        part.is_src[vision] = is_src
        return part

    @staticmethod
    def top_count(n: int, k: int) -> int:
        """The largest ``k_top <= n - 1`` with ``k_top + clusters(n - k_top) = k`` (one
        exists: the sum falls by 0 or 1 per step), else the largest below ``k``."""
        for top in range(min(k, n - 1), -1, -1):
            if top + recycled(n - top)[1] <= k:
                return top
        return 0


@Pruner.register("recycle_all")
@dataclass
class RecycleAll(AllSources):
    """Remove every A token, also in windows without a B token (they leave unmerged: the
    tokens SparseVLM prunes without recycling)."""

    def budget(self, graph, ratio):
        return graph.src_count if ratio > 0 else torch.zeros_like(graph.src_count)


@MessagePasser.register("plain_mean")
@dataclass
class PlainMean(MessagePasser):
    """The plain mean of a target and the tokens merged into it, each token counting once
    whatever it already holds (SparseVLM's cluster token: ``token_weight`` all ones)."""

    def weight(self, relevance, size):
        return torch.ones_like(relevance)
