"""A retrieval-circuit initialisation for the SymbolGrid decoder (the trainer's ``--circuit``).

On 2 CPU cores no generic initialisation let the decoder learn, within an hour, to fetch
the one vision token a question names out of 256 (see the trainer's docstring). This
module gives the decoder that skill at initialisation, the way mimetic initialisation
gives a prior, and training does the rest; no attention map is ever supervised.

Three pieces, all built from the model's own embeddings:

1. `structure_embeddings`: the word embedding of cell ``(r, c)`` is ``(R_r + C_c) / sqrt 2``
   (``R``, ``C`` seeded N(0, 1) vectors): cell names share row and column parts, as "r5"
   and "c7" would, so a linear map can read a cell's row and column out of its word (and
   the align stage makes every vision token carry ``M E[cell word]`` as well).
2. Retrieval heads in one decoder layer (`install`):

   - a *cell* head: its query reads the row and column of the question's last word (a
     cell word) as one-hot codes, its key reads them from each vision token's
     ``M E[cell]``; the value reads the token's symbol and the output writes that symbol's
     word embedding, so the tied output head can say it;
   - two *symbol* heads: query one-hot of the asked symbol, key one-hot of each vision
     token's symbol, a fixed weight ``S`` on ``<bos>`` (a sink) and the other text tokens
     far below; the value is 1 on vision tokens, so with logit ``L`` the head outputs
     ``(n e^L + N - n) / (n e^L + N - n + S)`` for ``n`` matching tokens out of ``N``
     along a residual direction of its own: a count the MLPs can read.

   The codes live in the head dimensions whose RoPE frequency is below ``1e-3``
   (rotation under 0.3 rad across the sequence), so retrieval does not depend on where
   the asked token sits.
3. `freeze`: the cell head's projections, the symbol heads' queries and their layer's
   input norm keep their values (their gradients are zeroed); everything else trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CircuitSpec", "freeze", "install", "invariant_dims", "structure_embeddings"]


@dataclass(frozen=True)
class CircuitSpec:
    """Where and how strongly the retrieval heads are built."""

    layer: int = 3
    """0-based decoder layer holding the heads."""
    cell_logit: float = 10.0
    """Attention logit per matching code (row or column) of the cell head."""
    symbol_logits: tuple[float, ...] = (3.0, 5.0)
    """Attention logit of a matching symbol, one symbol head each (other vision tokens: about
    0). Low on purpose: a token's symbol code varies by about 5%, so a high logit makes
    single tokens' weights, and with them the count, noisy."""
    sinks: tuple[float, ...] = (256.0, 512.0)
    """Weight of ``<bos>`` (an attention sink whose value is 0) in each symbol head."""
    text_logit: float = -3.0
    """Attention logit of the other text tokens in the symbol heads (they read vision tokens)."""
    gain: float = 3.0
    """Scale of the symbol word the cell head writes."""


def invariant_dims(head_dim: int) -> torch.Tensor:
    """Head dimensions rotated by the lowest half of the RoPE frequencies (pairs ``i >=
    head_dim / 4`` of ``rotate_half``): ``head_dim / 2`` of them."""
    q = head_dim // 4
    return torch.cat([torch.arange(q, 2 * q), torch.arange(3 * q, 4 * q)])


def _pinv_rows(vectors: torch.Tensor) -> torch.Tensor:
    """``[K, D]`` map ``L`` with ``L @ vectors[k] = e_k`` for linearly independent ``vectors [K,
    D]``."""
    return torch.linalg.pinv(vectors.T.double()).float()


def structure_embeddings(model, data, seed: int = 0) -> None:
    """Give cell words row + column embeddings (see the module docstring); in place."""
    emb = model.get_input_embeddings().weight
    n = data.MAX_GRID
    gen = torch.Generator().manual_seed(20_000 + seed)
    rows, cols = (
        torch.randn(n, emb.shape[1], generator=gen),
        torch.randn(n, emb.shape[1], generator=gen),
    )
    with torch.no_grad():
        for r in range(n):
            for c in range(n):
                emb[data.WORD_TO_ID[data.cell_word(r, c)]] = (rows[r] + cols[c]) / math.sqrt(2)
    model.tie_weights()


def _codes(model, data, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cell map [2G, D], symbol map [S, D])``: linear read-outs of a cell word's row and
    column one-hots and of a symbol word's one-hot."""
    emb = model.get_input_embeddings().weight.detach()
    pairs = [(r, c) for r in range(grid) for c in range(grid)]
    words = emb[[data.WORD_TO_ID[data.cell_word(r, c)] for r, c in pairs]]  # [G*G, D]
    codes = torch.zeros(len(pairs), 2 * grid)
    for i, (r, c) in enumerate(pairs):
        codes[i, r] = codes[i, grid + c] = 1.0
    # the least-squares map words -> codes; exact when the words are row + column sums
    cell_map = (torch.linalg.pinv(words.double()) @ codes.double()).T.float()  # [2G, D]
    symbols = emb[list(data.CONTENT_IDS)]
    return cell_map, _pinv_rows(symbols)


def _ridge(x: torch.Tensor, y: torch.Tensor, lam: float = 1e-6) -> torch.Tensor:
    """``[K, D]`` map ``W`` minimising ``|x W^T - y|^2 + lam |W|^2`` for ``x [M, D]``, ``y [M,
    K]``."""
    x, y = x.double(), y.double()
    gram = x.T @ x + lam * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.T @ y).T.float()


@torch.no_grad()
def install(
    model,
    data,
    grid: int,
    vision: torch.Tensor,
    symbols: torch.Tensor,
    spec: CircuitSpec = CircuitSpec(),
) -> list[int]:
    """Build the cell head (head 0) and the symbol heads (1, 2, ...) in ``spec.layer``.

    The key and value projections are least-squares probes (`_ridge`) fitted on
    normalised projected vision tokens of training images (targets: the token's row and
    column one-hots, its symbol one-hot) and on every word embedding (target zero, or far
    below every vision token for the symbol heads), so they read what the tower actually
    produces; the query projections read the question's last word exactly.

    Args:
        model: a ``LlavaForConditionalGeneration`` whose embeddings went through
            `structure_embeddings` and whose projector was aligned.
        data: the task's data module (`lightkv_lab.tasks.symbolgrid.data`).
        grid: cells per side.
        vision: ``[M, D]`` projected vision tokens of training images, raster order per image
            (``M`` a multiple of ``grid**2``).
        symbols: ``[M]`` the symbol index of each of those tokens.

    Returns:
        The heads built (for `freeze`).
    """
    layer = model.model.language_model.layers[spec.layer]
    attn = layer.self_attn
    dh = attn.head_dim
    inv = invariant_dims(dh)
    n_sym, g2 = len(data.CONTENT_IDS), grid * grid
    if 2 * grid > inv.numel() or n_sym > inv.numel():
        raise ValueError(
            f"head_dim {dh} has {inv.numel()} RoPE-invariant dimensions; need "
            f"{max(2 * grid, n_sym)} (use a larger head_dim)"
        )
    emb = model.get_input_embeddings().weight.detach()
    norm = layer.input_layernorm
    xv, xt = (
        norm(vision),
        norm(emb),
    )  # what the layer's projections see (its residual is still the input)
    # words weigh more than single tokens: a few hundred words against thousands of tokens,
    # and ``<bos>`` (the sink) most, since one row sets its key
    weight = torch.full((xt.shape[0], 1), 10.0)
    weight[data.BOS_ID] = 1000.0
    x = torch.cat([xv, xt * weight.sqrt()])
    cell = torch.arange(g2).repeat(vision.shape[0] // g2)
    zeros = torch.zeros(xt.shape[0], 1)

    def fit(
        hot: torch.Tensor, text_target: torch.Tensor | None = None, lift: float = 0.0
    ) -> torch.Tensor:
        """A probe reading ``hot [M, K]`` (0/1 classes) plus ``lift`` from vision tokens and
        ``text_target`` (default 0) from words. One refit makes the mean read-out of each
        class exactly 1 above the others: the first fit falls short by a different factor
        per class (e.g. for dim hues)."""
        text = zeros.expand(-1, hot.shape[1]) if text_target is None else text_target
        text = text * weight.sqrt()
        w = _ridge(x, torch.cat([hot + lift, text]))
        out = xv @ w.T
        on = (out * hot).sum(0) / hot.sum(0).clamp(min=1)
        off = (out * (1 - hot)).sum(0) / (1 - hot).sum(0).clamp(min=1)
        gain = torch.where(hot.any(0), 1 / (on - off).clamp(min=1e-3), torch.ones_like(on))
        return _ridge(x, torch.cat([hot * gain + lift, text]))

    rows_cols = torch.cat(
        [
            torch.nn.functional.one_hot(cell // grid, grid),
            torch.nn.functional.one_hot(cell % grid, grid),
        ],
        1,
    ).float()
    sym_hot = torch.nn.functional.one_hot(symbols, n_sym).float()
    cell_map, sym_map = _codes(model, data, grid)
    scale = 1 / math.sqrt(dh)
    heads = [0] + [1 + i for i in range(len(spec.symbol_logits))]
    q, k, v, o = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
    for h in heads:
        rows = slice(h * dh, (h + 1) * dh)
        q[rows] = 0
        k[rows] = 0
        v[rows] = 0
        o[:, rows] = 0
    # the layer's input norm rescales words to unit RMS: query maps act on normalised words
    rms = emb.pow(2).mean(-1).sqrt().mean()
    # cell head: logit = cell_logit * (row match + column match); writes the token's symbol word
    h0 = inv[: 2 * grid]
    q[h0] = cell_map * rms * (spec.cell_logit / scale)
    k[h0] = fit(rows_cols)
    v[:n_sym] = fit(sym_hot)
    o[:, :n_sym] = spec.gain * emb[list(data.CONTENT_IDS)].T
    gen = torch.Generator().manual_seed(30_000)
    # the symbol heads' query is exactly one-hot on each normalised symbol word (its scale
    # sets the sink's logit, which must not depend on the word)
    sym_rms = emb[list(data.CONTENT_IDS)].pow(2).mean(-1).sqrt()
    sym_word = sym_map * sym_rms[:, None]
    is_vision = _ridge(x, torch.cat([torch.ones(vision.shape[0], 1), zeros * weight.sqrt()]))
    for i, (logit, sink) in enumerate(zip(spec.symbol_logits, spec.sinks, strict=True)):
        h = 1 + i
        dims = h * dh + inv[:n_sym]
        q[dims] = sym_word * (logit / scale)
        # logits relative to the text tokens (0): a projection without bias can lift every
        # vision token (they share E[<image>]) but cannot push ~600 random words down
        lift = -spec.text_logit / logit
        text = torch.zeros(xt.shape[0], n_sym)
        text[data.BOS_ID] = (math.log(sink) - spec.text_logit) / logit
        k[dims] = fit(sym_hot, text, lift)
        v[h * dh] = is_vision[0]
        o[:, h * dh] = torch.randn(emb.shape[1], generator=gen)
    return heads


def freeze(model, layer: int, heads: list[int], query_only: list[int] = ()) -> None:
    """Zero gradients so the optimiser leaves what `install` built where it is (weight
    decay aside): all projections of ``heads`` and the layer's input norm, and only the
    query projection of ``query_only`` (their keys, values and outputs keep learning)."""
    block = model.model.language_model.layers[layer]
    attn = block.self_attn
    dh = attn.head_dim

    def mask(which) -> torch.Tensor:
        rows = torch.zeros(attn.q_proj.weight.shape[0], dtype=torch.bool)
        for h in which:
            rows[h * dh : (h + 1) * dh] = True
        return rows

    full, query = mask(heads), mask(list(heads) + list(query_only))
    attn.q_proj.weight.register_hook(lambda g: g.masked_fill(query[:, None], 0))
    for proj in (attn.k_proj, attn.v_proj):
        proj.weight.register_hook(lambda g: g.masked_fill(full[:, None], 0))
    attn.o_proj.weight.register_hook(lambda g: g.masked_fill(full[None, :], 0))
    block.input_layernorm.weight.register_hook(torch.zeros_like)
