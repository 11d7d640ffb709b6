"""The benchmarked model shapes: `ModelSpec` and `MODELS`.

`MODELS` holds the shapes of LLaVA-1.5-7B, LLaVA-NeXT-7B, Qwen2.5-VL-7B, InternVL3-8B,
LLaVA-OneVision-7B and Qwen2.5-VL-7B on a video: each real decoder (layers, width, heads, MLP),
the reduced one the benchmark runs (real head dimension `HEAD_DIM`, fewer heads) and the
builder arguments that give the real vision-token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HEAD_DIM", "MODELS", "ModelSpec"]

HEAD_DIM = 128


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model shape.

    Attributes:
        name: key (``--models``).
        title: the real model this imitates.
        family: `lightkv.testing.TINY_MODELS` key.
        ref: the real decoder: layers, hidden, heads, kv_heads, intermediate.
        heads, kv_heads: reduced attention heads (head_dim 128 kept); width = heads x 128.
        lightkv_preset: what the preset name ``lightkv`` means for this model.
        image: builder arguments giving the real vision-token count.
        video: the row builder's ``videos`` argument, for video shapes (None: no video).
    """

    name: str
    title: str
    family: str
    ref: dict[str, int]
    heads: int
    kv_heads: int
    lightkv_preset: str
    build_kwargs: dict[str, Any]
    image: Any
    image_note: str
    video: Any = None

    def reduced(
        self, layers: int, heads: int | None = None, full_width: bool = False
    ) -> dict[str, int]:
        """The benchmarked decoder: ``layers`` deep; the real width, heads and MLP with
        ``full_width``, else ``heads`` (default: this shape's reduced count) x 128 wide."""
        if full_width:
            ref = self.ref
            return {
                "layers": layers,
                "hidden": ref["hidden"],
                "heads": ref["heads"],
                "kv_heads": ref["kv_heads"],
                "intermediate": ref["intermediate"],
            }
        heads = heads or self.heads
        kv = max(1, heads * self.ref["kv_heads"] // self.ref["heads"])
        hidden = heads * HEAD_DIM
        inter = round(hidden * self.ref["intermediate"] / self.ref["hidden"] / 16) * 16
        return {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "kv_heads": kv,
            "intermediate": inter,
        }

    def weight_bytes(
        self, layers: int, heads: int | None = None, full_width: bool = False, element: int = 4
    ) -> int:
        """Bytes of the benchmarked decoder's weights (projections and MLP; embeddings and
        norms left out): what a run must hold in memory at least."""
        d = self.reduced(layers, heads, full_width)
        h, kv = d["hidden"], d["kv_heads"] * HEAD_DIM
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * d["intermediate"]
        return layers * per_layer * element


MODELS: dict[str, ModelSpec] = {
    "llava": ModelSpec(
        "llava",
        "LLaVA-1.5-7B",
        "llava",
        {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32, "intermediate": 11008},
        heads=4,
        kv_heads=4,
        lightkv_preset="lightkv",
        build_kwargs={"image_size": 48, "patch_size": 2},
        image=1,
        image_note="one 24x24 image (576 tokens)",
    ),
    "llava_next": ModelSpec(
        "llava_next",
        "LLaVA-NeXT-7B (Vicuna)",
        "llava_next",
        {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32, "intermediate": 11008},
        heads=4,
        kv_heads=4,
        lightkv_preset="lightkv",
        build_kwargs={
            "image_size": 48,
            "patch_size": 2,
            "pinpoints": ((96, 96), (48, 96), (96, 48)),
        },
        image=[(96, 96)],
        image_note="a 2x2-tile image: 24x24 base grid + 48x48 high-res grid with 48 row newlines "
        "(2,928 tokens)",
    ),
    "qwen2_5_vl": ModelSpec(
        "qwen2_5_vl",
        "Qwen2.5-VL-7B",
        "qwen2_5_vl",
        {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944},
        heads=7,
        kv_heads=1,
        lightkv_preset="lightkv-qwen2_5_vl",
        build_kwargs={"patch_size": 2},
        image=[(1, 64, 64)],
        image_note="a 64x64-patch image, 2x2 merge: 32x32 grid (1,024 tokens)",
    ),
    "internvl": ModelSpec(
        "internvl",
        "InternVL3-8B (Qwen2.5-7B decoder)",
        "internvl",
        {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944},
        heads=7,
        kv_heads=1,
        lightkv_preset="lightkv",
        build_kwargs={"image_size": 64, "patch_size": 2},
        image=[5],
        image_note="5 tiles of 16x16 (2x2 tiles + thumbnail, 1,280 tokens)",
    ),
    "llava_onevision": ModelSpec(
        "llava_onevision",
        "LLaVA-OneVision-7B (Qwen2-7B decoder)",
        "llava_onevision",
        {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944},
        heads=7,
        kv_heads=1,
        lightkv_preset="lightkv",
        build_kwargs={"image_size": 54, "patch_size": 2, "max_tiles": 3},
        image=[(162, 162)],
        image_note="an anyres-max-9 image of 3x3 tiles of 27x27: base tile (729) + 81x81 stitched "
        "grid: 7,290 vision tokens and 81 structural row newlines",
    ),
    "qwen2_5_vl_video": ModelSpec(
        "qwen2_5_vl_video",
        "Qwen2.5-VL-7B, video",
        "qwen2_5_vl",
        {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944},
        heads=7,
        kv_heads=1,
        lightkv_preset="lightkv-video",
        build_kwargs={"patch_size": 2},
        image=[],
        video=[(16, 32, 32)],
        image_note="a 16-frame video of 32x32 patches per frame, 2x2 merge: 16 frames of 16x16 "
        "(4,096 tokens)",
    ),
}
