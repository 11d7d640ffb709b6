"""The quality benchmark's provenance picture (`provenance_picture`): what a held-out question's
asked cell or object becomes under each method, drawn with `lightkv_lab.vis`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightkv_lab import vis

__all__ = ["TITLE_CHARS", "provenance_picture"]


TITLE_CHARS = 38
"""Characters per title line of a 3.6-inch panel at 9 pt: longer titles wrap, so none is
clipped at the picture's edge."""


def _title(ax: Any, text: str) -> None:
    import textwrap

    lines = [w for line in text.splitlines() for w in (textwrap.wrap(line, TITLE_CHARS) or [""])]
    ax.set_title("\n".join(lines), fontsize=9)


def provenance_picture(
    path: Path,
    model_dir: str | None = None,
    seed: int = 3,
    target: float = 0.55,
    methods: Sequence[str] = ("lightkv", "tome"),
) -> dict[str, Any]:
    """One held-out ``what`` question, in ``2 + len(methods)`` panels: the image; the prompt
    relevance ξ lightkv computes at its first stage (the model's own vision-query x text-key
    score); then for each method the final provenance, every original patch painted with the
    mean colour of the group of patches its surviving token stands for (the asked cell
    outlined in red). Returns what was drawn."""
    import random

    from lightkv.adapters import apply
    from lightkv.graph.layout import TokenKind
    from lightkv_lab.bench.budgets import knob_pipeline
    from lightkv_lab.tasks import evaluate as ev
    from lightkv_lab.tasks import model as dg
    from lightkv_lab.tasks.towers import fit_tower

    plt = vis.pyplot()
    path_ = dg.resolve_model(model_dir)
    model, _, grid = dg.load(path_)
    data = dg.read_task(path_).data
    rng = random.Random(f"provenance:{seed}")
    patch = model.config.vision_config.patch_size
    side = grid.image_size // patch
    k = grid.cell // patch
    n_img = side * side
    first_vision = 1  # <bos>, then the image tokens
    region_task = getattr(data, "ASKED_REGION", False)
    # a small object's texture (Scenes) or colour (Photos): a detail that merging can lose
    detail = next((q for q in ("texture", "small") if q in data.QTYPES), None)
    while True:
        if region_task and detail:
            ep = data.make_episode(rng, "heldout", detail, grid)
            if 1 < int(ep.meta["region"].sum()) <= 6:
                break
        else:
            ep = data.make_episode(rng, "heldout", "what", grid)
            if ep.answer != ["none"]:
                break
    if region_task and detail:
        asked_mask = ep.meta["region"].repeat_interleave(k, 0).repeat_interleave(k, 1)
    else:
        asked_mask = torch.zeros(side, side, dtype=torch.bool)
        asked_mask[
            ep.meta["row"] * k : (ep.meta["row"] + 1) * k,
            ep.meta["col"] * k : (ep.meta["col"] + 1) * k,
        ] = True
    rows_, cols_ = asked_mask.nonzero().T
    top, left = int(rows_.min()), int(cols_.min())
    high, wide = int(rows_.max()) - top + 1, int(cols_.max()) - left + 1
    area = float(asked_mask.float().mean())
    what = "object" if region_task else "cell"
    colours = (
        ep.image.reshape(3, side, patch, side, patch).mean((2, 4)).permute(1, 2, 0)
    )  # [side, side, 3]
    fig, axes = plt.subplots(1, 2 + len(methods), figsize=(3.6 * (2 + len(methods)), 4.4))
    vis.show(axes[0], ep.image.permute(1, 2, 0))
    _title(axes[0], f"'{' '.join(ep.question)}' -> {' '.join(ep.answer)}")
    drawn: dict[str, Any] = {
        "question": " ".join(ep.question),
        "answer": " ".join(ep.answer),
        "methods": {},
        "asked_area": area,
        "asked": what,
    }

    def outline(ax, scale: int) -> None:  # the asked cell or object, in red
        vis.outline_box(ax, left * scale, top * scale, wide * scale, height=high * scale)

    outline(axes[0], patch)
    num_layers = model.config.text_config.num_hidden_layers
    for i, name in enumerate(methods):
        pipe, _ = knob_pipeline(name, num_layers, target)
        pipe = fit_tower(pipe, model.config.vision_config.num_hidden_layers)
        with apply(pipe, model, record=True) as session:
            got = ev.answer(model, [ep], grid)[0]
            trace = session.last_prefill
        if i == 0:
            rec = trace.stages[0]
            vision = rec.layout.kind[0] == int(TokenKind.VISION)
            xi = rec.relevance[0][vision].float().reshape(side, side)
            vis.heatmap(axes[1], xi)
            outline(axes[1], 1)
            share = float(xi[asked_mask].sum() / xi.sum())
            _title(
                axes[1],
                f"{name} relevance ξ after layer {rec.layer}\n"
                f"{share:.0%} of it on the asked {what} (area {area:.1%})",
            )
            drawn["relevance_share_asked"] = share
        owner = trace.provenance.owner[0, first_vision : first_vision + n_img]
        groups = torch.unique(owner, return_inverse=True)[1]
        sizes = torch.bincount(groups)
        painted = vis.group_mean(owner, colours.reshape(-1, 3)).reshape(side, side, 3)
        ax = axes[2 + i]
        vis.show(ax, painted.clamp(0, 1))
        vis.draw_group_borders(ax, owner, (side, side))
        outline(ax, 1)
        asked = groups.reshape(side, side)[asked_mask]
        own = int(asked.flatten()[0])
        n_left = int(groups.max()) + 1
        kept = session.report().kept_vision_fraction
        _title(
            ax,
            f"{name} at {kept:.0%} kept: '{' '.join(got)}'\n"
            f"{n_left} tokens left; the asked {what}'s token stands for {int(sizes[own])}",
        )
        drawn["methods"][name] = {
            "answer": " ".join(got),
            "tokens_left": n_left,
            "asked_cell_tokens": len(torch.unique(asked)),
            "asked_group_size": int(sizes[own]),
        }
    vis.save_figure(fig, path, ticks=False)
    return drawn
