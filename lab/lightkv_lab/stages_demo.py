"""End-to-end demo of the pure core on a real image (``lightkv stages-demo``, ``python -m
lightkv_lab.stages_demo``).

No model is involved. The demo turns ``skimage.data.astronaut()`` into the kind of sequence
an LVLM prefill sees, with a stand-in for every model quantity:

* vision tokens: the 512x512 image is cropped to 504x504 and cut into a 24x24 grid of
  21x21-pixel patches (576 tokens, LLaVA-1.5's count). A token's hidden state (D=256) is
  its mean colour (3 channels, standardised) followed by a fixed, seeded random projection
  of its globally normalised pixels (253 channels). Merging is a weighted mean of hidden
  states, so the first 3 channels of a merged token are exactly the colour it now carries.
* text tokens: a few seeded random vectors before and after the image.
* prompt relevance ξ: the prompt is "the red/orange parts of the image"; a patch's ξ is a
  Gaussian kernel between its mean colour and an orange query colour (in ``[0, 1]``).

It then runs a preset's full schedule with `lightkv.Pipeline.run` (32 layers, like
LLaMA-7B), prints per stage how many vision tokens survive and how large a share of the
vision KV cache is kept, shows which original patches each survivor stands for as an
ASCII map, and writes ``lightkv-demo.png``: the original next to each preset's "merged
image" (every patch painted with the colour of the token that now represents it).
"""

from __future__ import annotations

import argparse
import string
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lightkv import ImageSegment, StageResult, VisionLayout
from lightkv.outputs import output_dir_problem, write_atomic
from lightkv.policies import average_kept_fraction
from lightkv.presets import PRESETS, get_preset
from lightkv_lab import vis

__all__ = ["DemoInputs", "PresetReport", "build_inputs", "main", "run_preset"]

GRID = 24
PATCH = 21
DIM = 256
NUM_LAYERS = 32
QUERY_RGB = (0.85, 0.35, 0.12)
"""The demo prompt's colour: orange (RGB in [0, 1])."""
QUERY_SIGMA = 0.2
PROMPT = "the red/orange parts of the image"
TEXT_BEFORE = 5  # e.g. "<s> USER :" ...
TEXT_AFTER = 9  # e.g. "Describe the red/orange parts of the image. ASSISTANT:"
SEED = 0
DEFAULT_PRESETS = ("lightkv", "lightkv-paper")
# Symbols for the ASCII provenance map (none of them is a relevance shade); they repeat if
# a preset keeps more survivors.
SYMBOLS = string.digits + string.ascii_letters + "$&?!<>~^/|(){}[]"


@dataclass(frozen=True)
class DemoInputs:
    """The demo sequence.

    Attributes:
        image: ``[504, 504, 3]`` uint8, the cropped image.
        patch_rgb: ``[576, 3]`` float, mean colour per patch in ``[0, 1]`` (raster order).
        hidden: ``[1, N, 256]`` hidden states of the whole sequence.
        layout: its `VisionLayout` (one 24x24 image at ``offset``).
        relevance: ``[1, N]`` ξ (0 for text tokens).
        offset: sequence index of the first vision token.
        colour_mean, colour_std: to turn hidden channels 0..2 back into RGB.
    """

    image: torch.Tensor
    patch_rgb: torch.Tensor
    hidden: torch.Tensor
    layout: VisionLayout
    relevance: torch.Tensor
    offset: int
    colour_mean: torch.Tensor
    colour_std: torch.Tensor


@dataclass(frozen=True)
class PresetReport:
    """What the demo measured for one preset.

    Attributes:
        name: preset name.
        results: the pipeline's stage results.
        layers, windows: per stage, the layer it follows and windows per side.
        counts: vision tokens after each stage.
        kept_fraction: vision KV kept averaged over the layers, from the actual counts.
        kept_fraction_analytic: the same from `average_kept_fraction` (no rounding).
        owner: ``[576]`` index, in the final sequence, of the token each patch merged into.
        group_size: ``[576]`` size of the final group each patch belongs to.
    """

    name: str
    results: list[StageResult]
    layers: list[int]
    windows: list[str]
    counts: list[int]
    kept_fraction: float
    kept_fraction_analytic: float
    owner: torch.Tensor
    group_size: torch.Tensor


def build_inputs(seed: int = SEED) -> DemoInputs:
    """Image -> patches -> features, relevance and layout (see the module docstring)."""
    from skimage import data

    img = torch.from_numpy(data.astronaut()[: GRID * PATCH, : GRID * PATCH].copy())
    pix = img.double() / 255.0  # [504, 504, 3]
    patches = (
        pix.reshape(GRID, PATCH, GRID, PATCH, 3)
        .permute(0, 2, 1, 3, 4)
        .reshape(GRID * GRID, PATCH * PATCH, 3)
    )
    rgb = patches.mean(dim=1)  # [576, 3]

    gen = torch.Generator().manual_seed(seed)
    flat = patches.reshape(GRID * GRID, -1)
    flat = (flat - flat.mean()) / flat.std()
    proj = torch.randn(flat.shape[1], DIM - 3, generator=gen, dtype=torch.float64)
    texture = flat @ proj
    texture = (texture - texture.mean(dim=0)) / texture.std(dim=0)
    colour_mean, colour_std = rgb.mean(dim=0), rgb.std(dim=0)
    vision = torch.cat([(rgb - colour_mean) / colour_std, texture], dim=1)

    n = TEXT_BEFORE + GRID * GRID + TEXT_AFTER
    hidden = torch.randn(1, n, DIM, generator=gen, dtype=torch.float64)
    hidden[0, TEXT_BEFORE : TEXT_BEFORE + GRID * GRID] = vision
    layout = VisionLayout.from_segments(
        1, n, [ImageSegment(row=0, offset=TEXT_BEFORE, grid=(GRID, GRID))]
    )

    dist2 = ((rgb - torch.tensor(QUERY_RGB, dtype=rgb.dtype)) ** 2).sum(dim=1)
    xi = torch.exp(-dist2 / (2 * QUERY_SIGMA**2))
    relevance = torch.zeros(1, n, dtype=torch.float64)
    relevance[0, TEXT_BEFORE : TEXT_BEFORE + GRID * GRID] = xi / xi.max()
    return DemoInputs(
        image=img,
        patch_rgb=rgb.float(),
        hidden=hidden.float(),
        layout=layout,
        relevance=relevance.float(),
        offset=TEXT_BEFORE,
        colour_mean=colour_mean.float(),
        colour_std=colour_std.float(),
    )


def run_preset(name: str, inputs: DemoInputs, num_layers: int = NUM_LAYERS) -> PresetReport:
    """Run preset ``name``'s whole schedule on the demo sequence."""
    pipe = get_preset(name)
    specs = pipe.scheduler.plan(num_layers)
    results = pipe.run(
        inputs.hidden, inputs.layout, num_layers=num_layers, relevance=inputs.relevance
    )
    n_vision = int(inputs.layout.vision_counts()[0])
    counts = [int(r.layout.vision_counts()[0]) for r in results]
    # Layers 0..l1 cache all vision tokens, l1+1..l2 those left after stage 1, and so on.
    cached, start, current = 0, 0, n_vision
    for spec, count in zip(specs, counts):
        cached += (spec.layer + 1 - start) * current
        start, current = spec.layer + 1, count
    cached += (num_layers - start) * current
    vis = slice(inputs.offset, inputs.offset + n_vision)
    if results:
        prov = results[-1].provenance
        owner = prov.owner[0, vis]
        sizes = prov.sizes()[0]
        group_size = torch.where(owner >= 0, sizes[owner.clamp_min(0)], torch.zeros_like(owner))
    else:
        owner = torch.arange(vis.start, vis.stop)
        group_size = torch.ones_like(owner)
    return PresetReport(
        name=name,
        results=results,
        layers=[s.layer for s in specs],
        windows=[
            str(s.windows_per_side) if s.windows_per_side else "x".join(map(str, s.window_size))
            for s in specs
        ],
        counts=counts,
        kept_fraction=cached / (num_layers * n_vision),
        kept_fraction_analytic=average_kept_fraction(specs, num_layers),
        owner=owner,
        group_size=group_size,
    )


# ---------------------------------------------------------------------- reporting
def _survivor_relevance(result: StageResult, relevance: torch.Tensor) -> float:
    origin = result.layout.origin[0][result.layout.vision_mask[0]]
    return float(relevance[0, origin].mean())


def format_table(report: PresetReport, inputs: DemoInputs, num_layers: int = NUM_LAYERS) -> str:
    """Per-stage table, KV fraction, and how the most relevant patches fared."""
    xi = inputs.relevance
    n_vision = int(inputs.layout.vision_counts()[0])
    vis_xi = xi[0, inputs.offset : inputs.offset + n_vision]
    lines = [
        f"preset {report.name!r}: {PRESETS[report.name].summary}",
        (
            f"  {'stage':<6}{'after layer':>12}{'windows/side':>14}{'vision kept':>13}"
            f"{'cached by layers':>18}{'mean xi of survivors':>22}"
        ),
    ]
    bounds = [-1] + report.layers + [num_layers - 1]
    lines.append(
        "  "
        f"{'input':<6}{'-':>12}{'-':>14}{n_vision:>13}{f'0-{bounds[1]}':>18}"
        f"{float(vis_xi.mean()):>22.3f}"
    )
    for i, res in enumerate(report.results):
        span = f"{bounds[i + 1] + 1}-{bounds[i + 2]}"
        lines.append(
            "  "
            f"{i + 1:<6}{report.layers[i]:>12}{report.windows[i]:>14}{report.counts[i]:>13}"
            f"{span:>18}{_survivor_relevance(res, xi):>22.3f}"
        )
    lines.append(
        f"  vision KV kept, averaged over {num_layers} layers: {report.kept_fraction:.4f} from the "
        f"counts ({report.kept_fraction_analytic:.4f} analytic, average_kept_fraction)"
    )
    k = max(1, n_vision // 10)
    top = torch.zeros(n_vision, dtype=torch.bool)
    top[vis_xi.topk(k).indices] = True
    gs = report.group_size.double()
    kept_own = torch.zeros(n_vision, dtype=torch.bool)
    if report.results:
        final = report.results[-1].layout
        origin = final.origin[0][final.vision_mask[0]] - inputs.offset
        kept_own[origin] = True
    lines.append(
        f"  after the last stage: the top-10% most relevant patches ({k}) sit in groups of "
        f"{float(gs[top].mean()):.2f} patches on average, the other {n_vision - k} in groups of "
        f"{float(gs[~top].mean()):.2f}; {int(kept_own[top].sum())}/{k} of them are still their own "
        f"token (vs {int(kept_own[~top].sum())}/{n_vision - k} of the rest)"
    )
    return "\n".join(lines)


def _symbol_grid(report: PresetReport) -> list[list[str]]:
    owner = report.owner.tolist()
    symbol: dict[int, str] = {}
    for o in owner:
        if o >= 0 and o not in symbol:
            symbol[o] = SYMBOLS[len(symbol) % len(SYMBOLS)]
    cells = [symbol.get(o, ".") for o in owner]
    return [cells[r * GRID : (r + 1) * GRID] for r in range(GRID)]


def format_maps(report: PresetReport, inputs: DemoInputs) -> str:
    """Relevance map (left) and provenance map (right), one line per patch row."""
    xi = inputs.relevance[0, inputs.offset : inputs.offset + GRID * GRID].reshape(GRID, GRID)
    shades = " .:-=+*#%@"
    groups = _symbol_grid(report)
    n_groups = len({o for o in report.owner.tolist() if o >= 0})
    head = (
        f"  relevance xi ({shades!r} = low..high)".ljust(6 + GRID)
        + f"   provenance after the last stage: {n_groups} survivors, one symbol each"
        + (" (symbols repeat)" if n_groups > len(SYMBOLS) else "")
        + ("; '.' = dropped" if (report.owner < 0).any() else "")
    )
    out = [head]
    for r in range(GRID):
        rel = "".join(shades[min(len(shades) - 1, int(float(v) * len(shades)))] for v in xi[r])
        prov = "".join(s * 2 for s in groups[r])
        out.append(f"  |{rel}|   |{prov}|")
    return "\n".join(out)


# ---------------------------------------------------------------------- image
def merged_views(report: PresetReport, inputs: DemoInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Two "merged image" views of a preset's final provenance.

    Returns:
        ``(group_mean, token_colour)``, each ``[504, 504, 3]`` uint8: every patch painted
        with the plain mean colour of its provenance group, and with the colour its
        surviving token actually carries (hidden channels 0..2, a relevance-weighted mix),
        group borders darkened (`lightkv_lab.vis`).
    """
    owner = report.owner
    valid = owner >= 0
    idx = owner.clamp_min(0)
    if report.results:
        hidden = report.results[-1].hidden[0, idx, :3]
    else:
        hidden = inputs.hidden[0, idx, :3]
    carried = hidden * inputs.colour_std + inputs.colour_mean
    carried = torch.where(valid.unsqueeze(1), carried, torch.zeros(1, 3))
    grid = (GRID, GRID)
    token_colour = vis.outline_groups(vis.paint_patches(carried, grid, PATCH), owner, grid, PATCH)
    return vis.merged_view(owner, inputs.patch_rgb, grid, PATCH), token_colour


def save_png(path: Path, reports: list[PresetReport], inputs: DemoInputs) -> Path:
    """Original | per preset: group mean colour, carried token colour. Saved with PIL."""
    from PIL import Image

    gap = torch.full((GRID * PATCH, 12, 3), 255, dtype=torch.uint8)
    panels = [inputs.image]
    for rep in reports:
        panels.extend([gap, *merged_views(rep, inputs)])
    picture = torch.cat(panels, dim=1).numpy()
    write_atomic(path, lambda f: Image.fromarray(picture).save(f, format="PNG"))
    return path


# ---------------------------------------------------------------------- CLI
def build_parser(prog: str = "python -m lightkv_lab.stages_demo") -> argparse.ArgumentParser:
    """The demo's command-line options (shared with ``lightkv stages-demo``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Compress the vision tokens of a real image with lightkv presets (no model "
        "needed).",
    )
    parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        help=f"preset to run; repeat for several (default: {' and '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument(
        "--out", default=".", help="directory for lightkv-demo.png (default: current directory)"
    )
    parser.add_argument("--no-png", action="store_true", help="do not write the PNG")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m lightkv_lab.stages_demo") -> int:
    """Run the demo; ``argv`` as on the command line (see `build_parser`), errors named after
    ``prog`` (``lightkv stages-demo`` from the command line)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    presets = args.preset or list(DEFAULT_PRESETS)
    out_dir = Path(args.out)
    problem = None if args.no_png else output_dir_problem(out_dir)  # checked before any output
    if problem:
        parser.error(
            f"--out {args.out}: {problem}; --out names a writable directory for lightkv-demo.png"
        )

    inputs = build_inputs()
    print(
        f"image: skimage astronaut, cropped to {GRID * PATCH}x{GRID * PATCH}, {GRID}x{GRID} "
        f"patches of {PATCH}x{PATCH} px -> {GRID * GRID} vision tokens (D={DIM}) between "
        f"{TEXT_BEFORE} + {TEXT_AFTER} text tokens"
    )
    print(
        f"prompt: {PROMPT!r}; relevance xi of a patch = similarity of its mean colour to "
        f"RGB{QUERY_RGB} (1 = most relevant)"
    )
    print(f"decoder: {NUM_LAYERS} layers (LLaMA-7B / LLaVA-1.5-7B)\n")
    reports = [run_preset(name, inputs) for name in presets]
    for rep in reports:
        print(format_table(rep, inputs))
        print()
        print(format_maps(rep, inputs))
        print()
    if not args.no_png:
        out = out_dir
        out.mkdir(parents=True, exist_ok=True)
        path = save_png(out / "lightkv-demo.png", reports, inputs)
        views = ", ".join(f"{r.name}: group mean colour, colour its token carries" for r in reports)
        print(f"wrote {path} (panels: original; {views})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
