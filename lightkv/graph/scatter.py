"""Scatter (segment) reductions with two interchangeable backends.

``native`` uses only ``torch`` (``scatter_add_`` / ``scatter_reduce_``); ``torch_scatter``
uses the optional [torch-scatter](https://github.com/rusty1s/pytorch_scatter) extension.
Both give the same results (sums may differ in the last bit where the summation order
differs); the tests check this. The default backend, ``"auto"``, picks ``torch_scatter``
when it is importable and ``native`` otherwise. On CPU the native path is as fast or
faster for the sizes lightkv meets, so nothing is lost without the extra.

Every function reduces ``src`` along dimension 0: ``out[i] = reduce(src[j] for j with
index[j] == i)`` for ``i`` in ``range(dim_size)``; empty groups give 0 (and index -1 for
arg-reductions).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Literal

import torch

__all__ = [
    "Backend",
    "available_backends",
    "get_backend",
    "use_backend",
    "scatter_sum",
    "scatter_mean",
    "scatter_max",
    "scatter_min",
    "segment_rank",
    "pack_rows",
    "right_align",
]

Backend = Literal["auto", "native", "torch_scatter"]

_HAS_TORCH_SCATTER = importlib.util.find_spec("torch_scatter") is not None
_backend: Backend = "auto"


def available_backends() -> list[str]:
    """The backends that can run here: always ``native``, plus ``torch_scatter`` if installed."""
    return ["native"] + (["torch_scatter"] if _HAS_TORCH_SCATTER else [])


def get_backend() -> str:
    """The backend the scatter functions use now (``auto`` resolved)."""
    return _resolve(None)


@contextlib.contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Use ``name`` for every scatter call inside the ``with`` block.

    Raises:
        ValueError: an unknown name, or ``torch_scatter`` when it is not installed.
    """
    global _backend
    _resolve(name)  # validate before switching
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def _resolve(name: Backend | None) -> str:
    name = _backend if name is None else name
    if name == "auto":
        return "torch_scatter" if _HAS_TORCH_SCATTER else "native"
    if name == "native":
        return name
    if name == "torch_scatter":
        if not _HAS_TORCH_SCATTER:
            raise ValueError(
                "scatter backend 'torch_scatter' is not installed; install the extra "
                "(`pip install --no-build-isolation torch-scatter`) or use backend 'native'"
            )
        return name
    raise ValueError(
        f"unknown scatter backend {name!r}; choose one of 'auto', 'native', 'torch_scatter'"
    )


def _check(src: torch.Tensor, index: torch.Tensor, dim_size: int) -> None:
    if index.dim() != 1 or index.shape[0] != src.shape[0]:
        raise ValueError(
            f"scatter index must be 1-D with one entry per row of src: index {tuple(index.shape)}, "
            f"src {tuple(src.shape)}"
        )
    if dim_size < 0:
        raise ValueError(f"dim_size must be >= 0, got {dim_size}")


def _expand(index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return index.view(-1, *([1] * (src.dim() - 1))).expand_as(src)


def scatter_sum(
    src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: Backend | None = None
) -> torch.Tensor:
    """Sum of ``src`` rows per group.

    Args:
        src: ``[M, *F]`` values.
        index: ``[M]`` int64 group of each row, in ``[0, dim_size)``.
        dim_size: number of groups ``G``.

    Returns:
        ``[G, *F]``.
    """
    _check(src, index, dim_size)
    if _resolve(backend) == "torch_scatter":
        import torch_scatter

        return torch_scatter.scatter(src, index, dim=0, dim_size=dim_size, reduce="sum")
    out = src.new_zeros((dim_size, *src.shape[1:]))
    # Not index_add_: on CPU it adds row by row, one parallel region per index, which is
    # 10-100x slower than scatter_add_ as soon as torch runs more than one thread.
    return out.scatter_add_(0, _expand(index, src), src)


def scatter_mean(
    src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: Backend | None = None
) -> torch.Tensor:
    """Mean of ``src`` rows per group (0 for empty groups). Shapes as `scatter_sum`."""
    _check(src, index, dim_size)
    if _resolve(backend) == "torch_scatter":
        import torch_scatter

        return torch_scatter.scatter(src, index, dim=0, dim_size=dim_size, reduce="mean")
    total = scatter_sum(src, index, dim_size, backend="native")
    count = torch.zeros(dim_size, dtype=src.dtype, device=src.device).scatter_add_(
        0, index, torch.ones_like(index, dtype=src.dtype)
    )
    return total / count.clamp_min(1).view(-1, *([1] * (src.dim() - 1)))


def _scatter_extreme(
    src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: Backend | None, largest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(src, index, dim_size)
    if _resolve(backend) == "torch_scatter":
        import torch_scatter

        fn = torch_scatter.scatter_max if largest else torch_scatter.scatter_min
        value, arg = fn(src, index, dim=0, dim_size=dim_size)
        arg = torch.where(arg >= src.shape[0], torch.full_like(arg, -1), arg)
        return value, arg
    if src.is_floating_point():
        fill = float("-inf") if largest else float("inf")
    else:  # integer values (e.g. frame indices): the dtype's own extremes
        info = torch.iinfo(src.dtype)
        fill = info.min if largest else info.max
    value = src.new_full((dim_size, *src.shape[1:]), fill)
    value.scatter_reduce_(
        0, _expand(index, src), src, reduce="amax" if largest else "amin", include_self=True
    )
    # Arg: the smallest row index that attains the extreme (deterministic ties).
    hit = src == value[index]
    rows = (
        torch.arange(src.shape[0], device=src.device)
        .view(-1, *([1] * (src.dim() - 1)))
        .expand_as(src)
    )
    cand = torch.where(hit, rows, torch.full_like(rows, src.shape[0]))
    arg = torch.full((dim_size, *src.shape[1:]), src.shape[0], dtype=torch.long, device=src.device)
    arg.scatter_reduce_(0, _expand(index, src), cand, reduce="amin", include_self=True)
    empty = arg >= src.shape[0]
    return value.masked_fill(empty, 0), arg.masked_fill(empty, -1)


def scatter_max(
    src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Maximum per group and the row that attains it.

    Returns:
        ``(values [G, *F], argmax [G, *F])``; empty groups give value 0 and argmax -1.
        Ties go to the smallest row index.
    """
    return _scatter_extreme(src, index, dim_size, backend, largest=True)


def scatter_min(
    src: torch.Tensor, index: torch.Tensor, dim_size: int, backend: Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum per group and the row that attains it (see `scatter_max`)."""
    return _scatter_extreme(src, index, dim_size, backend, largest=False)


def pack_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the True entries of each row, left-aligned.

    Args:
        mask: ``[B, N]`` bool.

    Returns:
        ``(index [B, T], valid [B, T])`` with ``T`` the largest count of a row: ``index[b, :k_b]``
        are row ``b``'s True positions in order, and ``valid`` marks them.
    """
    count = mask.sum(dim=1)
    width = int(count.max()) if count.numel() else 0
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :width]
    valid = torch.arange(width, device=mask.device).unsqueeze(0) < count.unsqueeze(1)
    return order, valid


def segment_rank(group: torch.Tensor) -> torch.Tensor:
    """Rank of each element inside its group, in the order the elements appear.

    Args:
        group: ``[M]`` int64 group ids (any non-negative values).

    Returns:
        ``[M]`` int64: 0 for the first element of each group, 1 for the second, ...
    """
    if group.numel() == 0:
        return group.clone()
    order = torch.sort(group, stable=True).indices
    sorted_group = group[order]
    first = torch.ones_like(sorted_group, dtype=torch.bool)
    first[1:] = sorted_group[1:] != sorted_group[:-1]
    position = torch.arange(group.numel(), device=group.device)
    start = torch.cummax(torch.where(first, position, torch.zeros_like(position)), dim=0).values
    rank = torch.empty_like(group)
    rank[order] = position - start
    return rank


def right_align(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's kept columns to the right, in order: generation reads the last
    column and appends there, so every row must end at the same place.

    Args:
        keep: ``[B, N]`` bool.

    Returns:
        ``(index [B, W], column [B, N])`` with ``W`` the largest kept count: ``index`` maps
        each new column to its old one (``-1`` for holes on the left), ``column`` each old
        column to its new one (``-1`` where not kept).
    """
    b, n = keep.shape
    count = keep.sum(dim=1)
    width = int(count.max()) if b else 0
    column = (width - count).unsqueeze(1) + keep.long().cumsum(dim=1) - 1
    column = torch.where(keep, column, torch.full_like(column, -1))
    rows = torch.arange(b, device=keep.device).unsqueeze(1).expand(b, n)
    index = torch.full((b, width), -1, dtype=torch.long, device=keep.device)
    index[rows[keep], column[keep]] = torch.arange(n, device=keep.device).expand(b, n)[keep]
    return index, column
