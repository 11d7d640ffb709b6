"""Which original tokens each surviving token stands for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Provenance"]


@dataclass(frozen=True)
class Provenance:
    """A map from original tokens to the current tokens that absorbed them.

    Attributes:
        owner: ``[B, N0]`` int64. For every token of the original (uncompressed) sequence,
            the index in the *current* sequence of the token that now represents it, or
            ``-1`` if it was dropped without being merged anywhere.
        current_len: length ``N`` of the current sequence.
        weight: ``[B, N0]`` float, what each original token counts for in `sizes` (None: 1).
    """

    owner: torch.Tensor
    current_len: int
    weight: torch.Tensor | None = None

    @classmethod
    def identity(
        cls, batch_size: int, seq_len: int, device: torch.device | str = "cpu"
    ) -> Provenance:
        """Every token represents itself."""
        owner = torch.arange(seq_len, device=device).expand(batch_size, seq_len).clone()
        return cls(owner, seq_len)

    def then(self, remap: torch.Tensor, new_len: int) -> Provenance:
        """Compose with one stage.

        Args:
            remap: ``[B, N]`` int64, for every token of the current sequence its index in
                the next sequence (itself if kept, its destination if merged), ``-1`` if
                dropped.
            new_len: length of the next sequence.
        """
        if remap.shape[1] != self.current_len:
            raise ValueError(
                f"remap covers {remap.shape[1]} tokens, provenance has {self.current_len}"
            )
        owner = torch.where(self.owner >= 0, remap.gather(1, self.owner.clamp_min(0)), self.owner)
        return Provenance(owner, new_len, self.weight)

    def sizes(self, length: int | None = None) -> torch.Tensor:
        """``[B, N]`` number of original tokens each current token represents (with `weight`:
        the sum of their weights, float)."""
        n = self.current_len if length is None else length
        idx = torch.where(self.owner >= 0, self.owner, torch.full_like(self.owner, n))
        each = torch.ones_like(idx) if self.weight is None else self.weight
        out = each.new_zeros(self.owner.shape[0], n + 1)
        out.scatter_add_(1, idx, each)
        return out[:, :n]

    def sources(self, row: int, index: int) -> list[int]:
        """Original token indices absorbed by current token ``index`` of batch row ``row``."""
        return (self.owner[row] == index).nonzero(as_tuple=True)[0].tolist()

    def to_networkx(self):
        """A ``networkx.DiGraph`` with an edge ``("cur", row, i) -> ("orig", row, j)`` for every
        original token ``j`` that current token ``i`` represents."""
        import networkx as nx

        g = nx.DiGraph()
        for row, owners in enumerate(self.owner.tolist()):
            for j, i in enumerate(owners):
                g.add_node(("orig", row, j))
                if i >= 0:
                    g.add_edge(("cur", row, i), ("orig", row, j))
        return g
