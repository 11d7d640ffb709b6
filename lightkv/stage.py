"""`Stage`: one composed compression step, a pure function of tensors.

A `Stage` takes hidden states ``[B, N, D]``, a `VisionLayout`, relevance ``[B, N]`` and
(optionally) the provenance so far, and returns shorter hidden states, the new layout, the
kept indices and the updated provenance. Adapters call it inside a model (`Pipeline` plans
which stages a model gets); tests and researchers call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .graph.bipartite import BipartiteGraph
from .graph.layout import VisionLayout
from .graph.provenance import Provenance
from .graph.scatter import right_align
from .policies.hashing import token_identity
from .policies.inputs import StageInputs
from .policies.partitioners import GridPartitioner, Partitioner
from .policies.passers import MessagePasser, RelevanceWeightedMean
from .policies.prompt import Prompt
from .policies.pruners import PruneInputs, Pruner, SmallestDivergence
from .policies.relevance import QueryAxisSoftmax, Relevance
from .policies.schedulers import StageSpec
from .policies.scorers import DEFAULT_DIVERGENCE_BYTES, CosineDivergence, EdgeScorer

__all__ = ["DIVERGENCE_MEMORY_MIB", "Stage", "StageResult", "check_memory", "placement_problem"]

DIVERGENCE_MEMORY_MIB = DEFAULT_DIVERGENCE_BYTES // 2**20
"""The default memory budget of a stage's pairwise divergence intermediates, in MiB."""


def check_memory(mib: object) -> None:
    """A positive whole number of MiB, else a `ValueError` naming the option."""
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
        raise ValueError(f"divergence_memory_mib must be a positive integer (MiB), got {mib!r}")


def placement_problem(spec: StageSpec, relevance: Relevance) -> str | None:
    """Why a stage placed as ``spec`` cannot compute ``relevance`` there (None: it can).

    A stage on a layer's cache (``spec.mode == "cache"``) sees the layer's projections only,
    not the vision tower's attention nor the prompt's hidden states. `lightkv.apply` and
    ``lightkv config validate`` both refuse such a stage with this message.
    """
    if spec.mode != "cache":
        return None
    what = (
        "the vision tower's attention"
        if relevance.reads_tower
        else "the prompt's embeddings (hidden states)"
        if relevance.reads_hidden
        else None
    )
    if what is None:
        return None
    return (
        f"the stage on layer {spec.layer}'s cache cannot compute relevance {relevance.name!r}: "
        f"it reads {what}, which a cache stage does not see; run the stage before "
        "the LLM or after a layer (placement: pre_llm or layer), or use a relevance "
        "from the layer's projections (accumulated_attention, query_softmax)"
    )


@dataclass(frozen=True)
class StageResult:
    """What one stage returns.

    Attributes:
        hidden: ``[B, N', D]`` hidden states after the stage; rows that keep fewer tokens
            than the longest row are left-padded with zero holes.
        layout: the layout of the new sequence (holes have kind PAD and origin -1).
        kept_index: ``[B, N']`` int64 index of each new token in the stage's input
            sequence, ``-1`` for holes.
        provenance: for every original token, which new token represents it.
        remap: ``[B, N]`` int64: for every input token its index in the new sequence
            (its destination's index if it was merged, ``-1`` if dropped).
    """

    hidden: torch.Tensor
    layout: VisionLayout
    kept_index: torch.Tensor
    provenance: Provenance
    remap: torch.Tensor

    @property
    def sizes(self) -> torch.Tensor:
        """``[B, N']`` number of original tokens each new token represents."""
        return self.provenance.sizes()


@dataclass
class Stage:
    """One compression step: a composition of policies plus its schedule entry.

    Attributes:
        spec: layer, removal ratio and windows (from the scheduler).
        partitioner: windows and A/B split.
        scorer: divergence on A x B edges; None for pure pruning (no partners).
        pruner: which A tokens leave.
        passer: how leaving tokens update their partners.
        relevance: the policy that computes ξ for this stage inside a model. Calling the
            stage takes ξ as a tensor (computing it needs the layer's queries and keys, which
            only an adapter has); adapters call `relevance_scores` with them at the stage's
            layer, and a policy's `needs` never includes it.
        divergence_memory_mib: how many MiB a non-bilinear edge scorer's pairwise
            intermediates may take at once (see `lightkv.policies.EdgeScorer.bilinear`);
            the scorer is evaluated in chunks of windows and source rows within it, with
            the same result.
    """

    spec: StageSpec
    partitioner: Partitioner = field(default_factory=GridPartitioner)
    scorer: EdgeScorer | None = field(default_factory=CosineDivergence)
    pruner: Pruner = field(default_factory=SmallestDivergence)
    passer: MessagePasser = field(default_factory=RelevanceWeightedMean)
    relevance: Relevance = field(default_factory=QueryAxisSoftmax)
    divergence_memory_mib: int = DIVERGENCE_MEMORY_MIB

    def __post_init__(self) -> None:
        check_memory(self.divergence_memory_mib)
        if self.pruner.needs_partner and self.scorer is None:
            raise ValueError(
                f"pruner {self.pruner.name!r} merges into a partner and needs an edge scorer; "
                "give a scorer or use a pruner that drops (lowest_relevance, random)"
            )
        if self.passer.merges and self.scorer is None:
            raise ValueError(
                f"message passer {self.passer.name!r} merges tokens and needs an edge scorer: "
                "give one (scorer: cosine) or use passer 'drop'"
            )

    @property
    def needs(self) -> frozenset[str]:
        """Names of the `StageInputs` features this stage's policies read (e.g.
        ``{"key_states"}``); an adapter computes key states only when they are needed."""
        out: frozenset[str] = frozenset()
        for policy in (self.partitioner, self.scorer, self.pruner, self.passer):
            if policy is not None:
                out |= policy.needs
        return out

    @property
    def tower_layers(self) -> tuple[int, ...]:
        """The vision tower layers this stage's policies read (``StageInputs.tower``), sorted."""
        layers = {
            layer
            for policy in (self.partitioner, self.scorer, self.pruner, self.passer)
            if policy is not None
            for layer in policy.tower_layers
        }
        return tuple(sorted(layers))

    def relevance_scores(
        self,
        queries: torch.Tensor | None,
        keys: torch.Tensor | None,
        layout: VisionLayout,
        **context: object,
    ) -> torch.Tensor:
        """ξ ``[B, N]`` for this stage from a layer's queries and keys (what adapters call):
        the stage's `relevance` policy, given only the context it reads (``prompt=`` when it
        `reads_prompt`, ``tower=`` when it `reads_tower`, ``hidden=`` when it
        `reads_hidden`)."""
        rel = self.relevance
        extra = {k: v for k, v in context.items() if getattr(rel, f"reads_{k}", False)}
        return rel.score(queries, keys, layout, **extra)

    # ------------------------------------------------------------------ the stage
    def __call__(
        self,
        hidden: torch.Tensor,
        layout: VisionLayout,
        relevance: torch.Tensor | None = None,
        provenance: Provenance | None = None,
        key_states: torch.Tensor | None = None,
        prompt: Prompt | None = None,
        tower: dict[int, torch.Tensor] | None = None,
    ) -> StageResult:
        """Run the stage.

        Args:
            hidden: ``[B, N, D]`` hidden states (residual stream) after the stage's layer.
            layout: their layout.
            relevance: ``[B, N]`` ξ (non-negative); None means uniform.
            provenance: provenance up to this stage (None: the input is original).
            key_states: ``[B, N, H_kv, d]`` the layer's keys per token (before RoPE), for
                policies that need them (`StageInputs.key_states`).
            prompt: the prefill's token ids, for policies that read the prompt.
            tower: ``{layer: [B, H, N]}`` the vision tower's attention at the `tower_layers`
                this stage's policies read.

        Returns:
            a `StageResult`.
        """
        if not isinstance(hidden, torch.Tensor) or not isinstance(layout, VisionLayout):
            raise TypeError(
                "Stage expects (hidden: torch.Tensor [B, N, D], layout: VisionLayout, ...)"
            )
        return self.run(
            StageInputs(
                layout, self.spec, hidden, relevance, key_states, provenance, prompt, tower=tower
            )
        )

    def run(self, inputs: StageInputs) -> StageResult:
        """Run the stage on prepared `StageInputs` (``inputs.spec`` is replaced by this
        stage's spec; ``inputs.hidden`` is required)."""
        budget = self.divergence_memory_mib * 2**20
        if inputs.spec != self.spec or inputs.divergence_budget != budget:
            inputs = replace(inputs, spec=self.spec, divergence_budget=budget)
        if inputs.hidden is None:
            raise ValueError("a stage needs hidden states: StageInputs(hidden=[B, N, D], ...)")
        inputs.check()
        for name in sorted(self.needs):
            inputs.features(name)  # a clear error now, not deep inside a policy
        missing = [layer for layer in self.tower_layers if layer not in (inputs.tower or {})]
        if missing:
            raise ValueError(
                f"this stage reads the vision tower's attention at layer(s) {missing}: pass "
                "tower={layer: [B, H, N]} (the LLaVA adapter does)"
            )
        hidden, layout, relevance, provenance = (
            inputs.hidden,
            inputs.layout,
            inputs.relevance,
            inputs.provenance,
        )
        b, n, _ = hidden.shape
        if provenance is None:
            provenance = Provenance.identity(b, n, hidden.device)
            inputs = replace(inputs, provenance=provenance)
        elif provenance.current_len != n or provenance.owner.shape[0] != b:
            raise ValueError(
                "provenance does not describe the current sequence (length or batch size differ)"
            )
        if self.spec.removal_ratio == 0.0:
            return self._identity(hidden, layout, provenance)

        part = self.partitioner.partition(inputs)
        graph = BipartiteGraph.build(part.window, part.is_src)
        if graph.num_nodes == 0:  # e.g. a text-only batch: nothing to compress
            return self._identity(hidden, layout, provenance)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        # The nodes' rows are never gathered as a whole: the scorer gathers its window
        # blocks and the passer the rows it merges straight from the [B * N, D] tokens.
        tokens = hidden.reshape(b * n, hidden.shape[-1])
        node_token = graph.node_row * n + graph.node_pos
        self._check_finite(tokens, node_token)
        xi = (
            graph.gather(relevance).to(acc)
            if relevance is not None
            else hidden.new_ones(graph.num_nodes, dtype=acc)
        )
        if not torch.isfinite(xi).all() or (xi < 0).any():
            raise ValueError("relevance of vision tokens must be finite and non-negative")
        size = graph.gather(provenance.sizes())

        if self.scorer is not None:
            best_dst, best_div = self.scorer.match(inputs, graph)
        else:
            best_dst = torch.full_like(graph.src_slots, -1)
            best_div = torch.zeros(graph.src_slots.shape, dtype=acc, device=hidden.device)
        pad = graph.src_slots < 0
        prune = PruneInputs(
            graph=graph,
            divergence=best_div,
            relevance=graph.blocks(xi, "src"),
            identity=graph.token_blocks(token_identity(layout), "src").masked_fill(pad, -1),
            stage=inputs,
        )
        removed, zeroed = self.pruner.choose(prune, self.spec.removal_ratio)
        if self.passer.merges and not self.pruner.needs_partner:
            # A pruner that keeps a set (DivPrune, CDPruner, ...) names no partners: each
            # token it drops merges into its window's most similar survivor instead.
            assert self.scorer is not None  # a merging passer has one (__post_init__)
            src, dst = self.scorer.match_survivors(inputs, part.window, graph, removed)
        else:
            src = graph.src_slots[removed]
            dst = best_dst[removed]

        if self.passer.merges:
            # per token: the nodes' ξ and sizes, zero elsewhere (no token outside the graph
            # is a source or a destination)
            xi_t = xi.new_zeros(b * n).index_put_((node_token,), xi)
            size_t = size.new_zeros(b * n).index_put_((node_token,), size)
            merged = (
                dst >= 0
            )  # a window with no survivor has nothing to merge into: its tokens leave
            receivers, new = self.passer(
                tokens, xi_t, size_t, node_token[src[merged]], node_token[dst[merged]]
            )
            provenance = self.passer.reweigh(
                provenance, xi_t, node_token[src[merged]], node_token[dst[merged]]
            )
        else:
            dst = torch.full_like(dst, -1)
            receivers, new = dst[:0], tokens[:0].to(acc)
        keep = torch.ones(b, n, dtype=torch.bool, device=hidden.device)
        keep[graph.node_row[src], graph.node_pos[src]] = False
        res = self._assemble(hidden, layout, provenance, keep, src, dst, receivers, new, graph)
        if zeroed is not None and bool(zeroed.any()):  # a pruner's padding: kept as zero vectors
            z = graph.src_slots[zeroed]
            res.hidden[graph.node_row[z], res.remap[graph.node_row[z], graph.node_pos[z]]] = 0
        return res

    @staticmethod
    def _check_finite(tokens: torch.Tensor, node_token: torch.Tensor) -> None:
        """A clear error when a vision token's hidden state holds NaN or inf (text and
        padding may hold anything). NaN/inf make a row's sum non-finite: one reduction
        per token, no element-wise mask; the exact check runs only on rows whose sum is
        not finite (a finite row can overflow its sum)."""
        rows = node_token[~torch.isfinite(tokens.sum(-1)[node_token])]
        if rows.numel() and not torch.isfinite(tokens[rows]).all():
            raise ValueError("hidden states of vision tokens contain NaN or inf")

    def _identity(
        self, hidden: torch.Tensor, layout: VisionLayout, provenance: Provenance
    ) -> StageResult:
        b, n, _ = hidden.shape
        index = torch.arange(n, device=hidden.device).expand(b, n).clone()
        return StageResult(hidden, layout, index, provenance, index)

    @staticmethod
    def _assemble(hidden, layout, provenance, keep, src, dst, receivers, new, graph) -> StageResult:
        b, n, d = hidden.shape
        kept_index, col = right_align(keep)  # holes on the left, every row ends at column W-1
        width = kept_index.shape[1]
        # One row copy per survivor: gather with an expanded index reads an index per element.
        flat = kept_index.clamp_min(0) + torch.arange(b, device=hidden.device).unsqueeze(1) * n
        out = hidden.reshape(b * n, d).index_select(0, flat.reshape(-1)).view(b, width, d)
        out.masked_fill_((kept_index < 0).unsqueeze(-1), 0)
        if receivers.numel():  # token indices into [B * N]
            r_row, r_pos = receivers // n, receivers % n
            out[r_row, col[r_row, r_pos]] = new.to(hidden.dtype)
        remap = col.clone()
        if src.numel():
            merged = dst >= 0
            s_row, s_pos = graph.node_row[src], graph.node_pos[src]
            target = torch.full_like(src, -1)
            target[merged] = col[graph.node_row[dst[merged]], graph.node_pos[dst[merged]]]
            remap[s_row, s_pos] = target
        return StageResult(
            hidden=out,
            layout=layout.select(kept_index),
            kept_index=kept_index,
            provenance=provenance.then(remap, width),
            remap=remap,
        )
