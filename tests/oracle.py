"""A slow, obviously-correct LightKV stage: Python loops per row, image and window, and
networkx for the bipartite structure. Independent of lightkv's tensor core (it reads
only the layout's plain per-token fields): windows come from band lengths written out
from the rules in words (never from `lightkv.graph.windows`' formulas)."""

from __future__ import annotations

import math

import networkx as nx

VISION = 1


def band_lengths(s: int, windows: int, rule: str) -> list[int]:
    """Lengths of the bands a side of ``s`` cells is cut into, first to last.

    * ``leading`` (the reference code): ``windows`` bands of ``s // windows`` cells, the
      first ``s % windows`` of them one longer; empty bands are dropped.
    * ``proportional`` (lightkv): band ``k`` starts at the first cell ``>= k * s / n``
      with ``n = min(windows, s)`` bands, i.e. at ``ceil(k * s / n)``.
    """
    if rule == "leading":
        base, extra = divmod(s, windows)
        lengths = [base + 1] * extra + [base] * (windows - extra)
        return [n for n in lengths if n > 0]
    n = min(windows, s)
    starts = [-(-k * s // n) for k in range(n)] + [s]
    return [starts[k + 1] - starts[k] for k in range(n)]


def band_of(index: int, lengths: list[int]) -> int:
    """Which band (0-based) cell ``index`` falls into, walking the band lengths."""
    end = 0
    for band, n in enumerate(lengths):
        end += n
        if index < end:
            return band
    raise AssertionError(f"cell {index} is beyond the side ({end} cells)")


def window_of(
    r: int, c: int, h: int, w: int, windows_per_side: int, rule: str = "proportional"
) -> tuple[int, int]:
    """True 2-D window of cell (r, c) on an h x w grid."""
    return band_of(r, band_lengths(h, windows_per_side, rule)), band_of(
        c, band_lengths(w, windows_per_side, rule)
    )


def pseudo_square_window(
    k: int, n: int, windows_per_side: int, rule: str = "leading"
) -> tuple[int, int]:
    """The k-th of n tokens laid row-major into the smallest square that holds them."""
    side = 1
    while side * side < n:
        side += 1
    lengths = band_lengths(side, windows_per_side, rule)
    return band_of(k // side, lengths), band_of(k % side, lengths)


def cosine_divergence(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return 1.0 - dot / (max(na, 1e-12) * max(nb, 1e-12))


def oracle_stage(
    hidden,
    layout,
    relevance,
    ratio,
    windows_per_side,
    pseudo_square=False,
    bands=None,
    cap="sources",
    min_tokens=0,
):
    """Returns, per row, (kept positions in the input sequence, new features as a list of
    lists, {kept position: sorted list of absorbed input positions}).

    ``bands``: the band rule (default: ``proportional`` on the grid, ``leading`` on the
    pseudo-square); ``cap``: ``sources`` (at most the window's A side) or ``half`` (at most
    half the window, rounded down); ``min_tokens``: a row is left alone when one of its
    images has fewer than ``min_tokens * windows_per_side**2`` vision tokens."""
    if bands is None:
        bands = "leading" if pseudo_square else "proportional"
    kind = layout.kind.tolist()
    image = layout.image.tolist()
    coords = layout.coords.tolist()
    grids = layout.image_grid.tolist()
    rows = []
    for b in range(len(kind)):
        x = {i: hidden[b, i].tolist() for i in range(len(kind[b]))}
        xi = relevance[b].tolist()
        # group vision tokens: image -> window -> positions in sequence order
        windows: dict[tuple, list[int]] = {}
        per_image: dict[int, list[int]] = {}
        for i, k in enumerate(kind[b]):
            if k == VISION:
                per_image.setdefault(image[b][i], []).append(i)
        if min_tokens and any(
            len(m) < min_tokens * windows_per_side**2 for m in per_image.values()
        ):
            kept = list(range(len(kind[b])))
            rows.append((kept, [x[i] for i in kept], {i: [i] for i in kept}))
            continue
        for img, members in per_image.items():
            h, w = grids[img]
            for rank, i in enumerate(members):
                if pseudo_square:
                    win = pseudo_square_window(rank, len(members), windows_per_side, bands)
                else:
                    win = window_of(coords[b][i][0], coords[b][i][1], h, w, windows_per_side, bands)
                windows.setdefault((img, win), []).append(i)
        removed, absorbed = set(), {i: [i] for i in range(len(kind[b]))}
        new_x = dict(x)
        for members in windows.values():
            a_side = members[0::2]
            b_side = members[1::2]
            g = nx.Graph()
            g.add_nodes_from(a_side, bipartite=0)
            g.add_nodes_from(b_side, bipartite=1)
            for a in a_side:
                for bb in b_side:
                    g.add_edge(a, bb, weight=cosine_divergence(x[a], x[bb]))
            assert nx.is_bipartite(g)
            best = {}
            for a in a_side:
                edges = sorted(g.edges(a, data="weight"), key=lambda e: (e[2], b_side.index(e[1])))
                if edges:
                    best[a] = (edges[0][2], edges[0][1])
            n = len(members)
            r = min(math.floor(ratio * n), len(a_side)) if b_side else 0
            if cap == "half":
                r = min(r, n // 2)
            chosen = sorted(best, key=lambda a: (best[a][0], a_side.index(a)))[:r]
            receivers: dict[int, list[int]] = {}
            for a in chosen:
                receivers.setdefault(best[a][1], []).append(a)
                removed.add(a)
            for dst, srcs in receivers.items():
                weights = [xi[dst]] + [xi[s] for s in srcs]
                if sum(weights) <= 0:
                    weights = [1.0] * len(weights)
                feats = [x[dst]] + [x[s] for s in srcs]
                total = sum(weights)
                new_x[dst] = [
                    sum(wt * f[d] for wt, f in zip(weights, feats)) / total
                    for d in range(len(x[dst]))
                ]
                absorbed[dst] = sorted([dst] + srcs)
        kept = [i for i in range(len(kind[b])) if i not in removed]
        rows.append((kept, [new_x[i] for i in kept], {i: absorbed[i] for i in kept}))
    return rows
