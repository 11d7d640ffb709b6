"""One batched bipartite graph over every window of every image of every batch row.

Nodes are the vision tokens that take part in a stage, flattened across the batch. Each
node belongs to one window and to one side: **A** (sources, candidates for removal) or
**B** (destinations). Edges only join A and B nodes of the same window.

Besides the flat node arrays the graph keeps a dense, padded view per window
(``src_slots [K, a_max]``, ``dst_slots [K, b_max]``) so that edge scores of all windows are
one batched matrix product (ToMe-style blocks), with no Python loop over windows, images
or rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scatter import scatter_sum, segment_rank

__all__ = ["BipartiteGraph"]


@dataclass(frozen=True)
class BipartiteGraph:
    """Batched bipartite graph (see module docstring).

    Attributes:
        node_row: ``[M]`` batch row of each node.
        node_pos: ``[M]`` sequence position of each node in its row.
        node_window: ``[M]`` window id in ``[0, K)``.
        node_is_src: ``[M]`` bool, True for side A.
        src_slots: ``[K, a_max]`` node index of each A node per window, ``-1`` padding.
        dst_slots: ``[K, b_max]`` node index of each B node per window, ``-1`` padding.
        window_size: ``[K]`` number of nodes per window (A and B).
    """

    node_row: torch.Tensor
    node_pos: torch.Tensor
    node_window: torch.Tensor
    node_is_src: torch.Tensor
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    window_size: torch.Tensor

    @classmethod
    def build(cls, window: torch.Tensor, is_src: torch.Tensor) -> BipartiteGraph:
        """Build the graph from a partition.

        Args:
            window: ``[B, N]`` int64 window id per token, ``-1`` for tokens outside the graph.
                Ids must be compact (``0 .. K-1``).
            is_src: ``[B, N]`` bool, True for side A (ignored where ``window < 0``).
        """
        if window.shape != is_src.shape:
            raise ValueError(
                f"window {tuple(window.shape)} and is_src {tuple(is_src.shape)} must have one shape"
            )
        inside = window >= 0
        node_row, node_pos = inside.nonzero(as_tuple=True)
        node_window = window[node_row, node_pos]
        node_is_src = is_src[node_row, node_pos].bool()
        k = int(node_window.max()) + 1 if node_window.numel() else 0
        window_size = scatter_sum(torch.ones_like(node_window), node_window, k)
        src_slots = cls._slots(node_window, node_is_src, k)
        dst_slots = cls._slots(node_window, ~node_is_src, k)
        return cls(node_row, node_pos, node_window, node_is_src, src_slots, dst_slots, window_size)

    @staticmethod
    def _slots(node_window: torch.Tensor, member: torch.Tensor, k: int) -> torch.Tensor:
        nodes = member.nonzero(as_tuple=True)[0]
        win = node_window[nodes]
        rank = segment_rank(win)
        width = int(rank.max()) + 1 if rank.numel() else 0
        slots = torch.full((k, width), -1, dtype=torch.long, device=node_window.device)
        slots[win, rank] = nodes
        return slots

    # ------------------------------------------------------------------ views
    @property
    def num_nodes(self) -> int:
        """``M``, the number of nodes (vision tokens taking part)."""
        return self.node_row.shape[0]

    @property
    def num_windows(self) -> int:
        """``K``, the number of windows across the batch."""
        return self.window_size.shape[0]

    @property
    def src_count(self) -> torch.Tensor:
        """``[K]`` number of A nodes per window."""
        return (self.src_slots >= 0).sum(dim=1)

    @property
    def dst_count(self) -> torch.Tensor:
        """``[K]`` number of B nodes per window."""
        return (self.dst_slots >= 0).sum(dim=1)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Per-node values from a per-token tensor: ``[B, N, *F]`` -> ``[M, *F]``."""
        return values[self.node_row, self.node_pos]

    def blocks(self, node_values: torch.Tensor, side: str, fill: float = 0.0) -> torch.Tensor:
        """Dense per-window blocks of node values.

        Args:
            node_values: ``[M, *F]``.
            side: ``"src"`` or ``"dst"``.

        Returns:
            ``[K, a_max or b_max, *F]``, ``fill`` in padding slots.
        """
        slots = self.src_slots if side == "src" else self.dst_slots
        out = node_values[slots.clamp_min(0)]
        # In place: the indexing above already made a copy; no second one, no host sync.
        pad = (slots < 0).view(*slots.shape, *([1] * (node_values.dim() - 1)))
        return out.masked_fill_(pad, fill)

    def token_blocks(self, values: torch.Tensor, side: str, fill: float = 0.0) -> torch.Tensor:
        """Dense per-window blocks straight from a per-token tensor: ``[B, N, *F]`` ->
        ``[K, a_max or b_max, *F]``, ``fill`` in padding slots.

        The same as ``blocks(gather(values), side, fill)`` with one copy instead of two
        (at 7B width a gathered ``[M, D]`` is tens of MB of fresh memory per stage).
        """
        slots = self.src_slots if side == "src" else self.dst_slots
        index = slots.clamp_min(0)
        out = values[self.node_row[index], self.node_pos[index]]
        pad = slots < 0
        return out.masked_fill_(pad.view(*pad.shape, *([1] * (values.dim() - 2))), fill)

    def window_groups(self, waste: float = 0.25, pairs: str = "ab") -> list[torch.Tensor]:
        """Windows grouped by size, so that padding each group to its own largest window
        wastes at most ``waste`` of its ``A x B`` pairs (one group when the whole graph
        does). Windows of very different sizes (an image's base view and its tiles, one
        window per image) otherwise pad the small ones to the largest.

        Args:
            waste: the share of padded pairs a group may carry.
            pairs: ``ab`` (A x B, what an edge scorer computes) or ``aa`` (A x A, what a
                keep-set pruner's pairwise distances cost).

        Returns:
            ``[K_g]`` int64 window ids per group (largest windows first), covering every
            window once.
        """
        if pairs not in ("ab", "aa"):
            raise ValueError(f"unknown pairs {pairs!r}; choose 'ab' or 'aa'")
        k = self.num_windows
        a = self.src_count.tolist()
        b = a if pairs == "aa" else self.dst_count.tolist()
        cost = [x * y for x, y in zip(a, b)]  # each window's pairs
        if k == 0 or k * max(a) * max(b) <= (1.0 + waste) * max(1, sum(cost)):
            return [torch.arange(k, device=self.src_slots.device)]
        order = sorted(range(k), key=lambda w: (-a[w], -b[w], w))
        group: list[int]  # the windows of the group being filled
        groups, group, b_max, used = [], [], 0, 0
        for w in order:
            bm = max(b_max, b[w])
            if group and (len(group) + 1) * a[group[0]] * bm > (1.0 + waste) * max(
                1, used + cost[w]
            ):
                groups.append(group)
                group, bm, used = [], b[w], 0
            group.append(w)
            b_max, used = bm, used + cost[w]
        groups.append(group)
        return [
            torch.tensor(sorted(g), dtype=torch.long, device=self.src_slots.device) for g in groups
        ]

    def select_windows(self, windows: torch.Tensor) -> BipartiteGraph:
        """The graph of some windows (``windows``, int64 ids): their slots, trimmed to
        their own largest window. Node arrays are shared with this graph (node ids, and
        ``node_window``, keep this graph's numbering), so node indices from the part are
        node indices here."""
        src, dst = self.src_slots[windows], self.dst_slots[windows]
        a = int((src >= 0).sum(1).max()) if src.numel() else 0
        b = int((dst >= 0).sum(1).max()) if dst.numel() else 0
        return BipartiteGraph(
            self.node_row,
            self.node_pos,
            self.node_window,
            self.node_is_src,
            src[:, :a],
            dst[:, :b],
            self.window_size[windows],
        )

    def to_networkx(self, divergence: torch.Tensor | None = None):
        """The graph as a ``networkx.Graph`` for inspection.

        Nodes are ``(row, pos)`` tuples with attributes ``window`` and ``side`` (``"A"`` or
        ``"B"``). Edges join every A node to every B node of its window; if ``divergence``
        (``[K, a_max, b_max]``, as returned by an edge scorer) is given, each edge carries it.
        """
        import networkx as nx

        g = nx.Graph()
        rows, pos = self.node_row.tolist(), self.node_pos.tolist()
        for i, (r, p) in enumerate(zip(rows, pos)):
            g.add_node(
                (r, p),
                window=int(self.node_window[i]),
                side="A" if bool(self.node_is_src[i]) else "B",
            )
        src, dst = self.src_slots.tolist(), self.dst_slots.tolist()
        for w in range(self.num_windows):
            for i, a in enumerate(src[w]):
                if a < 0:
                    continue
                for j, b in enumerate(dst[w]):
                    if b < 0:
                        continue
                    attrs = {} if divergence is None else {"divergence": float(divergence[w, i, j])}
                    g.add_edge((rows[a], pos[a]), (rows[b], pos[b]), **attrs)
        return g
