"""The pure tensor core: layouts, windows, the batched bipartite graph and scatter ops.

Nothing here knows about models; everything works on plain tensors.
"""

from .bipartite import BipartiteGraph
from .layout import ImageSegment, TokenKind, VisionLayout
from .provenance import Provenance
from .scatter import available_backends, get_backend, scatter_sum, segment_rank, use_backend
from .windows import grid_windows, pseudo_square_windows

__all__ = [
    "BipartiteGraph",
    "ImageSegment",
    "Provenance",
    "TokenKind",
    "VisionLayout",
    "available_backends",
    "get_backend",
    "grid_windows",
    "pseudo_square_windows",
    "scatter_sum",
    "segment_rank",
    "use_backend",
]
