"""Draw the figures of the documentation site into ``docs/assets/``.

    .venv/bin/python docs/scripts/make_figures.py [--out docs/assets]

Only the pure core runs (no model): ``skimage.data.astronaut()`` is cut into a 24x24 grid of
21x21-pixel patches (576 vision tokens, LLaVA-1.5's count) between a few text tokens; a
patch's hidden state is its mean colour plus a little texture, and the presets' schedules
are applied for a 32-layer decoder with `lightkv.Pipeline.run`. Pictures are drawn with
Pillow (a scikit-image dependency) and saved as palette PNGs, to keep them small.

Figures:

* ``lightkv-stages.png``: the image, then after each LightKV stage every patch painted with
  the mean colour of the group of patches its surviving token stands for (provenance),
  group borders dark and the stage's windows in blue: 4x4, then 2x2, then one window.
* ``bipartite-window.png``: one 6x6 window of the first stage: sources A (circles) and
  destinations B (squares), the best edge of every A token, and the edges along which
  tokens were merged (thick), at a removal ratio of 0.3.
* ``kv-steps.png``: vision tokens each decoder layer caches, per preset (step-shaped).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightkv_lab.vis import group_mean, outline_groups, paint_patches
from PIL import Image, ImageDraw, ImageFont

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.graph import BipartiteGraph
from lightkv.policies import (
    CosineDivergence,
    GridPartitioner,
    PruneInputs,
    SmallestDivergence,
    StageInputs,
)

GRID, PATCH = 24, 21
TEXT_BEFORE, TEXT_AFTER = 5, 9
NUM_LAYERS = 32
CELL = 10  # pixels per patch in the stage panels
ORANGE = (255, 140, 0)
BLUE = (0, 170, 255)
RED = (230, 20, 60)
INK = (30, 30, 30)
WHITE = (255, 255, 255)


def font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: a fixed bitmap font
        return ImageFont.load_default()


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, VisionLayout, torch.Tensor]:
    """``(image [504, 504, 3] uint8, patch colours [576, 3] in [0, 1], layout,
    hidden [1, N, 32])``."""
    from skimage import data

    image = torch.from_numpy(data.astronaut()[: GRID * PATCH, : GRID * PATCH].copy())
    pix = image.double() / 255
    patches = (
        pix.reshape(GRID, PATCH, GRID, PATCH, 3).permute(0, 2, 1, 3, 4).reshape(GRID * GRID, -1, 3)
    )
    rgb = patches.mean(dim=1)
    gen = torch.Generator().manual_seed(seed)
    flat = patches.reshape(GRID * GRID, -1)
    texture = (flat - flat.mean(dim=1, keepdim=True)) @ torch.randn(
        flat.shape[1], 26, generator=gen, dtype=torch.float64
    )
    texture = texture / texture.norm(dim=1, keepdim=True).clamp_min(1e-9)
    colour = (rgb - rgb.mean(dim=0)) / rgb.std(dim=0)
    vision = torch.cat([colour, 0.5 * patches.std(dim=1) / patches.std(), 0.3 * texture], dim=1)
    n = TEXT_BEFORE + GRID * GRID + TEXT_AFTER
    hidden = torch.randn(1, n, vision.shape[1], generator=gen, dtype=torch.float64)
    hidden[0, TEXT_BEFORE : TEXT_BEFORE + GRID * GRID] = vision
    layout = VisionLayout.from_segments(
        1, n, [ImageSegment(row=0, offset=TEXT_BEFORE, grid=(GRID, GRID))]
    )
    return image, rgb.float(), layout, hidden.float()


def panel(colours: torch.Tensor, owner: torch.Tensor | None, windows: int | None) -> Image.Image:
    """A ``24*CELL`` square: patch colours, dark group borders (`lightkv_lab.vis`), blue window
    lines."""
    img = paint_patches(colours, (GRID, GRID), CELL)
    if owner is not None:
        img = outline_groups(img, owner, (GRID, GRID), CELL)
    out = Image.fromarray(img.numpy())
    if windows:
        draw = ImageDraw.Draw(out)
        side = GRID * CELL
        for k in range(windows + 1):
            p = min(side - 2, round(k * side / windows))
            draw.rectangle([p - 1, 0, p + 1, side - 1], fill=BLUE)
            draw.rectangle([0, p - 1, side - 1, p + 1], fill=BLUE)
    return out


def save(img: Image.Image, path: Path, colours: int = 128) -> None:
    img.convert("RGB").quantize(
        colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
    ).save(path, optimize=True)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")


def stages_figure(out: Path) -> None:
    image, rgb, layout, hidden = inputs()
    pipe = lightkv.load("lightkv")
    specs = pipe.scheduler.plan(NUM_LAYERS)
    results = pipe.run(hidden, layout, num_layers=NUM_LAYERS)
    vis = slice(TEXT_BEFORE, TEXT_BEFORE + GRID * GRID)
    side = GRID * CELL
    small = Image.fromarray(image.numpy()).resize((side, side), Image.Resampling.LANCZOS)
    panels = [(small, f"input: {GRID * GRID} tokens", f"layers 0-{specs[0].layer} cache all")]
    for i, (spec, res) in enumerate(zip(specs, results)):
        owner = res.provenance.owner[0, vis]
        count = int(res.layout.vision_counts()[0])
        w = spec.windows_per_side
        windows = f"{w}x{w} windows" if w > 1 else "one window"
        until = specs[i + 1].layer if i + 1 < len(specs) else NUM_LAYERS - 1
        panels.append(
            (
                panel(group_mean(owner, rgb), owner, w),
                f"after layer {spec.layer}: {count} tokens",
                f"{windows}; layers {spec.layer + 1}-{until} cache {count}",
            )
        )
    gap, top, bottom = 14, 40, 8
    canvas = Image.new(
        "RGB", (len(panels) * side + (len(panels) - 1) * gap, top + side + bottom), WHITE
    )
    draw = ImageDraw.Draw(canvas)
    big, little = font(15), font(12)
    for i, (img, title, sub) in enumerate(panels):
        x = i * (side + gap)
        canvas.paste(img, (x, top))
        draw.text((x, 2), title, fill=INK, font=big)
        draw.text((x, 21), sub, fill=(90, 90, 90), font=little)
    save(canvas, out / "lightkv-stages.png")


def window_figure(out: Path, window_row: int = 1, window_col: int = 1, ratio: float = 0.3) -> None:
    """Stage 1 inside one 6x6 window, computed with the same policy objects as the preset.

    The preset's ratio 0.5 removes every A token of a window split half and half (there is
    nothing left to choose), so the figure uses a smaller ``ratio`` to show the pruner's choice.
    """
    _, rgb, layout, hidden = inputs()
    size = GRID // 4
    part = GridPartitioner().partition(StageInputs.of(layout, windows_per_side=4))
    graph = BipartiteGraph.build(part.window, part.is_src)
    x = graph.gather(hidden)
    best_dst, best_div = CosineDivergence().best_edges(graph, x)
    pad = graph.src_slots < 0
    prune = PruneInputs(
        graph,
        best_div,
        torch.ones_like(best_div),
        torch.zeros_like(graph.src_slots).masked_fill(pad, -1),
    )
    removed = SmallestDivergence().select(prune, ratio=ratio)

    def cell(node: int) -> tuple[int, int]:
        pos = int(graph.node_pos[node]) - TEXT_BEFORE
        return pos // GRID, pos % GRID

    r0, c0 = window_row * size, window_col * size
    target = int(part.window[0, TEXT_BEFORE + r0 * GRID + c0])
    s = 56  # pixels per patch
    margin = 10
    canvas = Image.new("RGB", (size * s + 2 * margin + 240, size * s + 2 * margin), WHITE)
    draw = ImageDraw.Draw(canvas)
    for r in range(size):
        for c in range(size):
            colour = tuple(int(v * 255) for v in rgb[(r0 + r) * GRID + c0 + c].tolist())
            draw.rectangle(
                [
                    margin + c * s,
                    margin + r * s,
                    margin + (c + 1) * s - 1,
                    margin + (r + 1) * s - 1,
                ],
                fill=colour,
            )

    def centre(rc: tuple[int, int]) -> tuple[float, float]:
        return margin + (rc[1] - c0 + 0.5) * s, margin + (rc[0] - r0 + 0.5) * s

    src_nodes = graph.src_slots[target]
    for slot, node in enumerate(src_nodes.tolist()):
        if node < 0 or int(best_dst[target, slot]) < 0:
            continue
        a, b = centre(cell(node)), centre(cell(int(best_dst[target, slot])))
        merged = bool(removed[target, slot])
        if merged:
            draw.line([a, b], fill=WHITE, width=8)
            draw.line([a, b], fill=RED, width=4)
        else:
            draw.line([a, b], fill=WHITE, width=2)
    for node in src_nodes.tolist():
        if node >= 0:
            x0, y0 = centre(cell(node))
            slot = src_nodes.tolist().index(node)
            merged = bool(removed[target, slot])
            draw.ellipse(
                [x0 - 9, y0 - 9, x0 + 9, y0 + 9],
                fill=RED if merged else WHITE,
                outline=WHITE if merged else INK,
                width=2,
            )
    for node in graph.dst_slots[target].tolist():
        if node >= 0:
            x0, y0 = centre(cell(node))
            draw.rectangle([x0 - 9, y0 - 9, x0 + 9, y0 + 9], fill=ORANGE, outline=WHITE, width=2)
    lx, f = margin + size * s + 18, font(13)
    legend = [
        ("square", "B: destination"),
        ("open", "A: source, kept"),
        ("filled", "A: source, merged"),
        ("thick", "merge edge"),
        ("thin", "best edge, not used (white)"),
    ]
    y = margin + 6
    for kind, text in legend:
        if kind == "square":
            draw.rectangle([lx, y, lx + 16, y + 16], fill=ORANGE, outline=INK, width=2)
        elif kind in ("open", "filled"):
            draw.ellipse(
                [lx, y, lx + 16, y + 16],
                fill=RED if kind == "filled" else WHITE,
                outline=INK,
                width=2,
            )
        else:
            draw.line(
                [lx, y + 8, lx + 16, y + 8],
                fill=RED if kind == "thick" else (170, 170, 170),
                width=4 if kind == "thick" else 2,
            )
        draw.text((lx + 24, y), text, fill=INK, font=f)
        y += 28
    n_a = int((src_nodes >= 0).sum())
    n_removed = int(removed[target].sum())
    draw.text((lx, y + 10), f"window of {size}x{size} = {size * size}", fill=INK, font=f)
    draw.text((lx, y + 30), f"|A| = {n_a}, removed r = {n_removed}", fill=INK, font=f)
    draw.text((lx, y + 50), f"P = {ratio}: r = min(floor(P n_w), |A|)", fill=INK, font=f)
    save(canvas, out / "bipartite-window.png", colours=64)


def kv_steps_figure(
    out: Path, presets: tuple[str, ...] = ("lightkv", "fastv", "pdrop", "pool")
) -> None:
    _, _, layout, hidden = inputs()
    colours = [(63, 81, 181), (230, 81, 0), (0, 150, 136), (156, 39, 176)]
    series = []
    for name in presets:
        pipe = lightkv.load(name)
        specs = pipe.scheduler.plan(NUM_LAYERS)
        counts = [
            int(r.layout.vision_counts()[0])
            for r in pipe.run(hidden, layout, num_layers=NUM_LAYERS)
        ]
        per_layer, current, k = [], GRID * GRID, 0
        for layer in range(NUM_LAYERS):
            per_layer.append(current)
            if k < len(specs) and specs[k].layer == layer:
                current, k = counts[k], k + 1
        series.append((name, per_layer, sum(per_layer) / (NUM_LAYERS * GRID * GRID)))
    w, h, left, bottom, top, right = 620, 260, 44, 40, 34, 190
    canvas = Image.new("RGB", (left + w + right, top + h + bottom), WHITE)
    draw = ImageDraw.Draw(canvas)
    f = font(12)
    ymax = GRID * GRID

    def xy(layer: float, tokens: float) -> tuple[float, float]:
        return left + layer * w / NUM_LAYERS, top + h - tokens * h / ymax

    for t in range(0, ymax + 1, 144):
        y = xy(0, t)[1]
        draw.line([left, y, left + w, y], fill=(225, 225, 225), width=1)
        draw.text((left - 30, y - 7), f"{t:>3}", fill=INK, font=f)
    for layer in range(0, NUM_LAYERS + 1, 4):
        x = xy(layer, 0)[0]
        draw.line([x, top + h, x, top + h + 4], fill=INK)
        draw.text((x - 6, top + h + 6), str(layer), fill=INK, font=f)
    draw.text((left + w / 2 - 60, top + h + 22), "decoder layer (0-based)", fill=INK, font=f)
    draw.line([left, top, left, top + h, left + w, top + h], fill=INK, width=1)
    for i, (name, per_layer, kept) in enumerate(series):
        points = []
        for layer, count in enumerate(per_layer):
            points += [xy(layer, count), xy(layer + 1, count)]
        off = (i - 1.5) * 1.2  # keep coinciding lines visible
        draw.line([(x, y + off) for x, y in points], fill=colours[i % len(colours)], width=3)
        ly = top + 10 + i * 24
        draw.line(
            [left + w + 16, ly + 7, left + w + 40, ly + 7], fill=colours[i % len(colours)], width=3
        )
        draw.text((left + w + 46, ly), f"{name}: {kept:.0%} kept", fill=INK, font=f)
    draw.text(
        (left, 6),
        f"vision tokens in each layer's KV cache ({NUM_LAYERS} layers, one {GRID}x{GRID} image)",
        fill=INK,
        font=font(13),
    )
    save(canvas, out / "kv-steps.png", colours=32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    stages_figure(args.out)
    window_figure(args.out)
    kv_steps_figure(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
