"""MMTok: keep the vision tokens that best cover both the question's tokens and the image's
tokens (maximum coverage, greedy).

Dong, Hu, Zhang, Yin, Fu, Qian, "MMTok: Multimodal Coverage Maximization for Efficient
Inference of VLMs", ICLR 2026 (arXiv:2508.18264); code github.com/Ironieser/MMTok
(``mmtok/core/semantic_selector.py`` at d1522cd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner

__all__ = ["MMTok"]


@Pruner.register("mmtok")
@dataclass
class MMTok(KeepSetPruner):
    """Greedy maximum coverage of ``[P; alpha Q]`` in each window.

    The rule (paper, method section: vision token selection as a maximum coverage problem whose
    subset covers the text tokens (text-vision coverage) and the original vision tokens
    (vision-vision coverage), optimised greedily as a submodular function; the authors'
    ``SemanticTokenSelector.mm_coverage_selection`` and ``greedy_merged_jit_kernel``,
    ``mmtok/core/semantic_selector.py`` lines 23-65 and 88-148 of
    github.com/Ironieser/MMTok at d1522cd):

    * ``P[m, j] = softmax_j(cos(t_m, x_j) / tau_tv) / M`` for the ``M`` text tokens
      ``t_m`` (softmax over the window's vision tokens ``j``; lines 108, 113);
    * ``Q[i, j] = softmax_j(cos(x_i, x_j) / tau_vv) / n`` for the window's ``n`` vision
      tokens (lines 109, 114), ``cos(x_j, x_j) = 1``;
    * ``C = [P; alpha Q]`` (lines 117-118); the coverage of a set ``S`` is
      ``f(S) = sum_r max_{j in S} C[r, j]``; each step adds the token of largest gain
      ``sum_r max(0, C[r, j] - best_r)`` (``best`` zero-initialised, lines 44, 55), ties to
      the earliest (``argmax``, line 57), then ``best = max(best, C[:, j])`` (line 63);
    * defaults ``alpha = 0.5``, ``tau_tv = 0.02``, ``tau_vv = 0.2``
      (``mmtok/llava/llava_inject.py`` ``mmtok()``, the ``mmtok_config`` defaults, lines 56-62).

    The text tokens. The code embeds the question's words (stop words and the answer-format
    sentences removed, ``mmtok/core/text_processor.py``) with the LLM's own token embeddings
    (``mmtok_core.py``, ``_encode_text_with_token_pooling``) and compares them with the
    projected image features, i.e. both in the LLM's input space. Here the text tokens are
    the stage's hidden states of the question (`Prompt.question_mask`: the text after the
    row's last vision token; in the pre-LLM mode these are the same input embeddings),
    without the ids in ``exclude`` (a caller's stop-word ids; none by default, so template
    tokens after the image count too). A row without question tokens has no ``P`` rows:
    pure vision coverage (the code has no such case).

    What else differs: ``Q`` compares the stage's features (the code compares the CLIP
    tower's features, ``vision_tokens_clip``); the kept count is each window's exact
    budget (`exact_removals`) instead of a fixed ``target_vision_tokens``; each window (one
    image with the ``global`` partitioner) is selected on its own, every window of the
    batch at once; the coverage runs in float64.

    Attributes:
        alpha: weight of the vision-vision coverage (the code's 0.5).
        tau_tv: softmax temperature of the text-vision similarities (0.02).
        tau_vv: softmax temperature of the vision-vision similarities (0.2).
        exclude: question token ids not covered (e.g. stop words).
        features: the vision tokens' features for ``Q``: ``hidden`` or ``key_states``; ``P``
            always reads the hidden states (the question's keys are not in the image
            tokens' space).
    """

    reads_prompt: ClassVar[bool] = True
    """Reads ``StageInputs.prompt`` (its question tokens): a host that cannot give the
    prompt to the stage refuses this pruner rather than run it blind."""

    alpha: float = 0.5
    tau_tv: float = 0.02
    tau_vv: float = 0.2
    exclude: tuple[int, ...] = ()
    features: Features = "hidden"

    def __post_init__(self) -> None:
        for name, positive in (("alpha", False), ("tau_tv", True), ("tau_vv", True)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or (value <= 0 if positive else value < 0)
            ):
                raise ValueError(
                    f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}"
                )
        self.exclude = tuple(int(i) for i in self.exclude)

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def coverage(self, inputs) -> torch.Tensor:
        """``[K, T + a_max, a_max]`` float64 ``C``: the rows of ``P`` (``T``: the most
        question tokens of any row; zero rows where a row has fewer) above ``alpha Q``
        (zero on padding rows and columns)."""
        graph = inputs.graph
        stage = self.stage_of(inputs, "mmtok")
        valid = graph.src_slots >= 0
        k = valid.shape[0]
        x = self.unit_features(inputs, stage, self.features).to(torch.float64)
        n = valid.sum(1).clamp_min(1).to(torch.float64)  # [K]
        cos = x @ x.transpose(1, 2)
        cos.diagonal(dim1=1, dim2=2).fill_(1.0)
        pair = valid.unsqueeze(1) & valid.unsqueeze(2)
        q = torch.softmax((cos / self.tau_vv).masked_fill(~valid.unsqueeze(1), -math.inf), dim=2)
        q = torch.where(pair, q, torch.zeros_like(q)) / n.view(k, 1, 1)
        rows = [float(self.alpha) * q]
        if stage.prompt is not None and stage.hidden is not None:
            question = stage.prompt.question_mask(stage.layout)
            if self.exclude:
                question = question & ~stage.prompt.match(stage.layout, self.exclude)
            m = int(question.sum(1).max()) if question.numel() else 0
            if m:
                # [B, T] positions of each row's question tokens (padding: -1), then per window
                pos = torch.arange(stage.layout.seq_len, device=valid.device).expand_as(question)
                order = torch.sort(
                    torch.where(question, pos, pos + stage.layout.seq_len), dim=1
                ).indices[:, :m]
                present = question.gather(1, order)  # [B, T]
                row = torch.zeros(k, dtype=torch.long, device=valid.device).scatter_(
                    0, graph.node_window, graph.node_row
                )
                h = stage.hidden
                t = self.unit_rows(h[row.unsqueeze(1), order[row]]).to(torch.float64)  # [K, T, D]
                xh = self.unit_features(inputs, stage, "hidden").to(torch.float64)
                # [K, T, a] with T the question's tokens: each step in place, one block alive
                logits = t @ xh.transpose(1, 2)
                logits.div_(self.tau_tv).masked_fill_(~valid.unsqueeze(1), -math.inf)
                p = (
                    torch.ops.aten._softmax.out(logits, 2, False, out=logits)
                    if logits.is_cpu
                    else torch.softmax(logits, dim=2)
                )
                has = present[row]  # [K, T]
                count = has.sum(1).clamp_min(1).to(torch.float64)
                p.masked_fill_(~(has.unsqueeze(2) & valid.unsqueeze(1)), 0.0)
                rows.insert(0, p.div_(count.view(k, 1, 1)))
        return torch.cat(rows, dim=1)

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` greedy coverage picks of window ``k``."""
        graph = inputs.graph
        valid = graph.src_slots >= 0
        k = valid.shape[0]
        kept = torch.zeros_like(valid)
        steps = int(count.max()) if k else 0
        if steps == 0:
            return kept
        c = self.coverage(inputs)  # [K, R, a]
        best = torch.zeros(c.shape[:2], dtype=c.dtype, device=c.device)  # [K, R]
        windows = torch.arange(k, device=c.device)
        # one [K, R, a] buffer for every step's gains (the same operations, in place): with a long
        # question R is thousands of rows, and two fresh blocks per step were two of its size
        buf = torch.empty_like(c)
        for t in range(steps):
            active = count > t
            gain = (
                torch.sub(c, best.unsqueeze(2), out=buf)
                .clamp_min_(0)
                .sum(dim=1)
                .masked_fill(~valid | kept, -math.inf)
            )
            j = gain.argmax(dim=1)  # first maximum
            kept[windows, j] |= active
            best = torch.maximum(best, c[windows, :, j])
        return kept
