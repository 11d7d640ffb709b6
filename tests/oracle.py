"""A slow, obviously-correct LightKV stage: Python loops per row, image and window, and
networkx for the bipartite structure. Independent of lightkv's tensor core (it reads
only the layout's plain per-token fields)."""

from __future__ import annotations

import math

import networkx as nx

VISION = 1


def window_of(r: int, c: int, h: int, w: int, windows_per_side: int) -> tuple[int, int]:
    """True 2-D window of cell (r, c) on an h x w grid: near-equal bands per side."""
    n_r, n_c = min(windows_per_side, h), min(windows_per_side, w)
    return (r * n_r // h, c * n_c // w)


def pseudo_square_window(k: int, n: int, windows_per_side: int) -> tuple[int, int]:
    side = math.isqrt(n)
    if side * side < n:
        side += 1
    return ((k // side) * windows_per_side // side, (k % side) * windows_per_side // side)


def cosine_divergence(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return 1.0 - dot / (max(na, 1e-12) * max(nb, 1e-12))


def oracle_stage(hidden, layout, relevance, ratio, windows_per_side, pseudo_square=False):
    """Returns, per row, (kept positions in the input sequence, new features as a list of
    lists, {kept position: sorted list of absorbed input positions})."""
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
        for img, members in per_image.items():
            h, w = grids[img]
            for rank, i in enumerate(members):
                if pseudo_square:
                    win = pseudo_square_window(rank, len(members), windows_per_side)
                else:
                    win = window_of(coords[b][i][0], coords[b][i][1], h, w, windows_per_side)
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
                new_x[dst] = [sum(wt * f[d] for wt, f in zip(weights, feats)) / total for d in range(len(x[dst]))]
                absorbed[dst] = sorted([dst] + srcs)
        kept = [i for i in range(len(kind[b])) if i not in removed]
        rows.append((kept, [new_x[i] for i in kept], {i: absorbed[i] for i in kept}))
    return rows
