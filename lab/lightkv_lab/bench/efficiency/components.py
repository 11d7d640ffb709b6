"""Where a compressed prefill's time goes, by component, against its FLOPs (issue 49, item 5).

The analytic FLOPs ratio counts the language model only; a prefill also runs the vision
tower, the projector, lightkv's selection and, for proportional attention, a bias. This
module times each of them inside one prefill and prints the time to first token (TTFT) ratio
beside the FLOPs ratio, so the gap between the two is explained in milliseconds:

* ``tower``: the vision tower's forward (every tile), which compression does not cut;
* ``projector``: the multimodal projector's forward;
* ``selection``: lightkv's own hooks (`OverheadProbe`: layout, relevance, stage, per-layer
  bookkeeping, the last of which builds each layer's mask and bias);
* ``layers``: the decoder layers' forwards without lightkv's hooks, with ``attention``
  (the layers' attention modules: projections, RoPE and the kernel) as a part of it;
* ``rest``: what remains of the TTFT (embedding, packing the tiles, final norm, LM head,
  the greedy token, Python);
* ``bias``: not a hook but a paired difference: the same kept tokens with proportional
  attention (``mask`` route: a 4-D additive mask; ``channel`` route: the extra head channel)
  minus without it (``lightkv-cover-no-pa``), in the same round.

The model is LLaVA-NeXT-7B's shape with random weights: CLIP ViT-L/14 at 336 px (24 layers,
1,024 wide; the projector reads the second-to-last layer), a 672 x 672 image (five tiles,
2,928 vision tokens), the Vicuna-7B decoder (4,096 wide, 32 heads, MLP 11,008) at a depth of
``layers`` (32 in float32 needs 27 GB; 16 fits a 24 GiB machine). `run_components` runs
every variant once per round, interleaved, after a warm-up (the uncompressed prefill
and the first compressed one), and reports medians.

```python
from lightkv_lab.bench.efficiency.components import ComponentConfig, run_components
out = run_components(ComponentConfig(tiny=True, rounds=1, kept=(0.22,)))
out["rows"][0]["components_ms"].keys()
```
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightkv_lab.bench.efficiency.measure import OverheadProbe, first_token
from lightkv_lab.bench.efficiency.shapes import POST_TEXT, PRE_TEXT

__all__ = [
    "ComponentConfig",
    "ComponentTimer",
    "add_bias",
    "build_llava_next_7b",
    "components_markdown",
    "run_components",
    "tower_flops",
]

UNCOMPRESSED = "uncompressed"
PRESETS = ("lightkv-cover", "lightkv-cover-channel", "lightkv-cover-no-pa", "divprune")
"""The compared variants: ``lightkv-cover`` with its bias on the 4-D mask, the same through the
extra head channel (``proportional_route="channel"``, the FlashAttention-2 route), the same
kept tokens without the bias, and DivPrune (no merge, no bias)."""

# CLIP ViT-L/14-336 (LLaVA-NeXT's tower) and Vicuna-7B, as their released configs give them
TOWER = dict(hidden=1024, mlp=4096, layers=24, heads=16, image=336, patch=14)
DECODER = dict(hidden=4096, mlp=11008, heads=32, vocab=32064)
PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
TINY_TOWER = dict(hidden=32, mlp=64, layers=2, heads=2, image=28, patch=14)
TINY_DECODER = dict(hidden=64, mlp=128, heads=4, vocab=128)


@dataclass
class ComponentConfig:
    """What `run_components` measures.

    Attributes:
        layers: decoder depth (the schedules are resolved for it by the budget knob).
        image: the image's ``(height, width)`` in pixels (672 x 672: five tiles).
        kept: kept fractions of the vision tokens.
        presets: compressed variants (`PRESETS`).
        rounds: timed rounds, after a warm-up.
        threads: torch intra-op threads (None: torch's default).
        tiny: a two-layer, 64-wide model with a two-layer tower (a check, not a claim).
    """

    layers: int = 16
    image: tuple[int, int] = (672, 672)
    kept: tuple[float, ...] = (0.22, 0.11, 0.05)
    presets: tuple[str, ...] = PRESETS
    rounds: int = 3
    threads: int | None = None
    tiny: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if self.layers < 2:
            raise ValueError(f"layers must be at least 2, got {self.layers}")
        bad = [p for p in self.presets if p not in PRESETS]
        if bad:
            raise ValueError(f"unknown variant(s) {bad}; choose from {list(PRESETS)}")
        bad = [k for k in self.kept if not 0.0 < k < 1.0]
        if bad:
            raise ValueError(f"kept fractions must lie in (0, 1), got {bad}")


def build_llava_next_7b(cfg: ComponentConfig):
    """``(model, inputs)``: LLaVA-NeXT with a real-size CLIP-L tower and the 7B decoder's width
    at ``cfg.layers`` layers (random weights, float32), and a one-row prompt with one image."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig
    from transformers import LlavaNextForConditionalGeneration as Model

    from lightkv.testing import IMAGE
    from lightkv_lab.tiny import TINY_MODELS

    tower, dec = (TINY_TOWER, TINY_DECODER) if cfg.tiny else (TOWER, DECODER)
    scale = tower["image"] / TOWER["image"]
    vision = CLIPVisionConfig(
        hidden_size=tower["hidden"],
        intermediate_size=tower["mlp"],
        num_hidden_layers=tower["layers"],
        num_attention_heads=tower["heads"],
        image_size=tower["image"],
        patch_size=tower["patch"],
        projection_dim=768,
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        hidden_size=dec["hidden"],
        intermediate_size=dec["mlp"],
        num_hidden_layers=cfg.layers,
        num_attention_heads=dec["heads"],
        num_key_value_heads=dec["heads"],
        vocab_size=dec["vocab"],
        max_position_embeddings=4096,
    )
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        image_grid_pinpoints=[[round(h * scale), round(w * scale)] for h, w in PINPOINTS],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Model(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_()
    fam = TINY_MODELS["llava_next"]
    size = (round(cfg.image[0] * scale), round(cfg.image[1] * scale))
    row = fam.row(model, [size], pre=PRE_TEXT, post=POST_TEXT, seed=0)
    return model, fam.collate([row])


class ComponentTimer:
    """Forward hooks that time the tower, the projector, the decoder layers and their
    attention modules (seconds, summed over a prefill). Layer timers start after lightkv's
    pre-hooks and stop before its post-hooks, so the layers' time holds none of lightkv's
    own work. Remove with `close`."""

    def __init__(self, model):
        core = model.model
        self.totals = {"tower": 0.0, "projector": 0.0, "layers": 0.0, "attention": 0.0}
        self._t: dict[str, float] = {}
        self._handles = []
        self._around(core.vision_tower, "tower")
        self._around(core.multi_modal_projector, "projector")
        for layer in core.language_model.layers:
            self._around(layer, "layers")
            self._around(layer.self_attn, "attention")

    def _around(self, module, key: str) -> None:
        def start(*_a, **_k):
            self._t[key] = time.perf_counter()

        def stop(*_a, **_k):
            self.totals[key] += time.perf_counter() - self._t.pop(key)

        self._handles.append(module.register_forward_pre_hook(start))
        self._handles.append(module.register_forward_hook(stop, prepend=True))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _pipeline(variant: str, layers: int, kept: float):
    from lightkv_lab.bench.budgets import knob_pipeline

    base = "lightkv-cover" if variant == "lightkv-cover-channel" else variant
    return knob_pipeline(base, layers, kept)[0]


def _prefill(model, inputs, variant: str, kept: float | None, layers: int) -> dict[str, Any]:
    """One timed prefill of ``variant`` at ``kept``: its TTFT, components and FLOPs
    (``flops``: the decoder's and the uncompressed decoder's, None uncompressed)."""
    from lightkv.adapters import apply

    session = contextlib.nullcontext()
    if variant != UNCOMPRESSED:
        route = "channel" if variant == "lightkv-cover-channel" else "auto"
        session = apply(_pipeline(variant, layers, kept), model, proportional_route=route)
    with torch.no_grad(), session as s:
        probe = OverheadProbe(s, lambda: None) if s is not None else None  # CPU: no sync
        timer = ComponentTimer(model)
        t0 = time.perf_counter()
        first_token(model, inputs)
        ttft = time.perf_counter() - t0
        timer.close()
        parts, flops, kept_frac = {**timer.totals, "selection": 0.0}, None, None
        if probe is not None:
            probe.close()
            parts["selection"] = sum(probe.totals.values())
            parts.update({f"selection_{k}": v for k, v in probe.totals.items()})
            report = s.report()
            flops = (report.prefill_flops, report.prefill_flops_baseline)
            kept_frac = report.kept_vision_fraction
    main = ("tower", "projector", "layers", "selection")
    parts["rest"] = ttft - sum(parts[k] for k in main)
    return {"ttft": ttft, "parts": parts, "flops": flops, "kept_vision_fraction": kept_frac}


def tower_flops(model, tiles: int) -> float:
    """Analytic forward FLOPs of the vision tower on ``tiles`` tiles (2 per multiply-add:
    projections, MLP, attention over all tokens; the patch embedding included)."""
    v = model.config.vision_config
    n = (v.image_size // v.patch_size) ** 2 + 1
    d, m = v.hidden_size, v.intermediate_size
    per_layer = 2 * n * (4 * d * d + 2 * d * m) + 4 * n * n * d
    embed = 2 * (n - 1) * 3 * v.patch_size**2 * d
    return tiles * (v.num_hidden_layers * per_layer + embed)


def run_components(cfg: ComponentConfig, progress=print) -> dict[str, Any]:
    """Every variant once per round (uncompressed first), ``cfg.rounds`` rounds after a
    warm-up of the first two variants; per variant the median TTFT, the median of each
    component, the LLM's FLOPs ratio and the TTFT ratio minus it in points, and the whole
    model's FLOPs ratio (the tower's FLOPs added to both sides)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, inputs = build_llava_next_7b(cfg)
    tiles = int(inputs["pixel_values"].shape[1])
    variants = [(UNCOMPRESSED, None)] + [(p, k) for k in cfg.kept for p in cfg.presets]
    samples: dict[tuple[str, float | None], list[dict]] = {v: [] for v in variants}
    for v in variants[:2]:  # warm-up: the allocator, the thread pool, the first hooks
        out = _prefill(model, inputs, v[0], v[1], cfg.layers)
        progress(f"warm-up: {v[0]}@{v[1]} {out['ttft']:.2f} s")
    for r in range(1, cfg.rounds + 1):
        for v in variants:
            out = _prefill(model, inputs, v[0], v[1], cfg.layers)
            samples[v].append(out)
            progress(f"round {r}: {v[0]}@{v[1]} {out['ttft']:.2f} s")
    llm_base = next(o[0]["flops"][1] for v, o in samples.items() if v[0] != UNCOMPRESSED)
    t_flops = tower_flops(model, tiles)
    rows, base = [], None
    for (name, kept), runs in samples.items():
        med = {k: statistics.median(o["parts"][k] for o in runs) for k in runs[0]["parts"]}
        ttft = statistics.median(o["ttft"] for o in runs)
        llm = runs[0]["flops"][0] / llm_base if name != UNCOMPRESSED else 1.0
        row = {
            "variant": name,
            "kept": kept,
            "kept_vision_fraction": runs[0]["kept_vision_fraction"],
            "ttft_ms": 1000 * ttft,
            "ttft_ms_rounds": [round(1000 * o["ttft"], 1) for o in runs],
            "components_ms": {k: 1000 * v for k, v in med.items()},
            "llm_flops_ratio": llm,
            "model_flops_ratio": (llm * llm_base + t_flops) / (llm_base + t_flops),
        }
        if name == UNCOMPRESSED:
            base = row
        rows.append(row)
    for row in rows:
        row["ttft_ratio"] = row["ttft_ms"] / base["ttft_ms"]
        row["ttft_minus_llm_flops_pp"] = 100 * (row["ttft_ratio"] - row["llm_flops_ratio"])
        row["ttft_minus_model_flops_pp"] = 100 * (row["ttft_ratio"] - row["model_flops_ratio"])
    add_bias(rows)
    return {
        "config": asdict(cfg),
        "tiles": tiles,
        "vision_tokens": int((inputs["input_ids"] == model.config.image_token_id).sum()),
        "llm_flops_uncompressed": llm_base,
        "tower_flops": t_flops,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }


def add_bias(rows: list[dict]) -> None:
    """``bias_ms``: a biased variant's TTFT minus ``lightkv-cover-no-pa``'s at the same kept
    fraction (the same kept tokens, no bias), round by round (the rounds interleave the
    variants, so each pair ran side by side), and the median of those differences."""
    plain = {r["kept"]: r for r in rows if r["variant"] == "lightkv-cover-no-pa"}
    for r in rows:
        if r["variant"] in ("lightkv-cover", "lightkv-cover-channel") and r["kept"] in plain:
            pairs = zip(r["ttft_ms_rounds"], plain[r["kept"]]["ttft_ms_rounds"])
            r["bias_ms_rounds"] = [round(a - b, 1) for a, b in pairs]
            r["bias_ms"] = statistics.median(r["bias_ms_rounds"])


COLUMNS = ("tower", "projector", "selection", "layers", "attention", "rest")


def components_markdown(result: dict[str, Any]) -> str:
    """The run as a Markdown table: per variant and kept fraction, TTFT, its ratio, the FLOPs
    ratios, the gap in points and each component's milliseconds (medians)."""
    cfg = result["config"]
    head = (
        f"LLaVA-NeXT-7B shape ({'tiny check' if cfg['tiny'] else 'CLIP-L/336 tower, 24 layers'}; "
        f"decoder {cfg['layers']} layers), {result['vision_tokens']:,} vision tokens in "
        f"{result['tiles']} tiles; {result['threads']} threads, torch {result['torch']}; medians "
        f"of {cfg['rounds']} rounds after a warm-up, variants interleaved.\n\n"
        "| variant | kept | TTFT ms | TTFT ratio | LLM FLOPs | TTFT - LLM FLOPs (pp) | "
        "model FLOPs | TTFT - model FLOPs (pp) | bias ms | "
        + " | ".join(f"{c} ms" for c in COLUMNS)
        + " |\n|---|---:|"
        + "---:|" * (8 + len(COLUMNS))
        + "\n"
    )
    lines = []
    for r in result["rows"]:
        kept = "-" if r["kept"] is None else f"{100 * r['kept']:g}%"
        bias = f"{r['bias_ms']:+,.0f}" if "bias_ms" in r else ""
        comp = " | ".join(f"{r['components_ms'][c]:,.0f}" for c in COLUMNS)
        lines.append(
            f"| {r['variant']} | {kept} | {r['ttft_ms']:,.0f} | {r['ttft_ratio']:.3f} | "
            f"{r['llm_flops_ratio']:.3f} | {r['ttft_minus_llm_flops_pp']:+.1f} | "
            f"{r['model_flops_ratio']:.3f} | {r['ttft_minus_model_flops_pp']:+.1f} | {bias} | "
            f"{comp} |"
        )
    return head + "\n".join(lines) + "\n"
