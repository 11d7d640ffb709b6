"""Shared builders for the subset-pruner tests (DivPrune, CDPruner, DART): a batch's graph
with one window per image and every token a candidate, as the presets run them."""

from __future__ import annotations

import math

import torch

from lightkv import ImageSegment, VisionLayout
from lightkv.graph.bipartite import BipartiteGraph
from lightkv.policies import DropMessages, GlobalPartitioner, PruneInputs, StageInputs, StageSpec
from lightkv.stage import Stage

PARTITIONER = GlobalPartitioner(scope="image", split="all_src")


def slow_cos(a: list[float], b: list[float]) -> float:
    """Cosine of two plain lists, one product at a time (the slow references' metric)."""
    dot = sum(p * q for p, q in zip(a, b))
    return dot / (math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in b)))


def prune_inputs(stage: StageInputs) -> PruneInputs:
    """`PruneInputs` over one window per image (``global``, ``all_src``)."""
    part = PARTITIONER.partition(stage)
    graph = BipartiteGraph.build(part.window, part.is_src)
    zeros = torch.zeros(graph.src_slots.shape, dtype=torch.float64)
    return PruneInputs(
        graph, zeros, torch.ones_like(zeros), torch.zeros_like(graph.src_slots), stage
    )


def one_image(hidden: torch.Tensor, before: int = 1, after: int = 2, **tensors) -> StageInputs:
    """One row: ``before`` text tokens, an image of ``n = hidden.shape[0] - before - after``
    tokens (a ``1 x n`` grid), ``after`` text tokens."""
    n = hidden.shape[0] - before - after
    layout = VisionLayout.from_segments(
        1, hidden.shape[0], [ImageSegment(row=0, offset=before, grid=(1, n))]
    )
    return StageInputs.of(layout, hidden.unsqueeze(0), windows_per_side=1, **tensors)


def kept_positions(prune: PruneInputs, removed: torch.Tensor) -> list[list[int]]:
    """Per window, the sequence positions of the kept A tokens, in order."""
    graph = prune.graph
    out = []
    for w in range(graph.num_windows):
        slots = graph.src_slots[w]
        keep = (slots >= 0) & ~removed[w]
        out.append(graph.node_pos[slots[keep]].tolist())
    return out


def stage(pruner, ratio: float) -> Stage:
    """A pure-pruning stage with ``pruner`` (as the presets compose it)."""
    return Stage(
        spec=StageSpec(0, ratio, windows_per_side=1),
        partitioner=PARTITIONER,
        scorer=None,
        pruner=pruner,
        passer=DropMessages(),
    )


def assert_rows_independent(pruner, inputs: StageInputs, ratio: float) -> None:
    """Every row keeps the same tokens (and as many) in the batch as alone."""
    st = stage(pruner, ratio)
    batch = st.run(inputs)
    for b in range(inputs.batch_size):
        row = StageInputs(
            inputs.layout.row(b),
            inputs.spec,
            hidden=inputs.hidden[b : b + 1],
            key_states=None if inputs.key_states is None else inputs.key_states[b : b + 1],
            relevance=None if inputs.relevance is None else inputs.relevance[b : b + 1],
            prompt=None
            if inputs.prompt is None
            else type(inputs.prompt)(inputs.prompt.token_ids[b : b + 1]),
        )
        alone = st.run(row)
        kept_b = batch.layout.origin[b][batch.layout.valid_mask[b]]
        kept_a = alone.layout.origin[0][alone.layout.valid_mask[0]]
        assert torch.equal(kept_b, kept_a), (
            f"row {b}: {kept_b.tolist()} in the batch, {kept_a.tolist()} alone"
        )
