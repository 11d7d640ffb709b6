"""Proportional attention's routes on a GPU (marked ``cuda``; skipped without one, run by
``benchmarks/gpu_check.sh``, which also times them with ``benchmarks/bias_routes.py``):
`lightkv-cover` under the real FlashAttention-2 kernel (the bias channel, head dim 129
padded to 136 inside the kernel), under sdpa through the channel, and through compiled
FlexAttention, each against the sdpa mask route on the same GPU in the same dtype: the
same greedy tokens, logits within the dtype's tolerance (relative to the largest logit).
The model: tiny LLaVA with the real head dim (128) and grouped-query attention (2 query
heads per KV head)."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply
from lightkv.adapters.attention import AttentionWatch
from lightkv.presets import get_preset

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these)",
    ),
]
GEN = dict(
    max_new_tokens=6,
    min_new_tokens=6,
    do_sample=False,
    output_logits=True,
    return_dict_in_generate=True,
)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
HEAD_DIM = 128


def _has_flash() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _model_and_batch(dtype):
    fam = TINY_MODELS["llava"]
    model = fam.build(
        attn_implementation="sdpa", hidden_size=2 * HEAD_DIM, num_heads=2, num_kv_heads=1
    ).eval()
    batch = fam.collate(fam.examples(model)[:2])  # left-padded rows of unequal images
    model = model.to("cuda", dtype)
    batch = {
        k: (v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda"))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }
    return model, batch


def _run(model, batch, route="auto"):
    with torch.no_grad(), apply(get_preset("lightkv-cover"), model, proportional_route=route):
        with AttentionWatch(model) as watch:
            out = model(**batch, use_cache=True)
        gen = model.generate(**batch, **GEN)
    return out, gen, dict(watch.ran)


def _close(ref, got, dtype) -> None:
    assert torch.equal(got[1].sequences, ref[1].sequences)
    for a, b in zip([got[0].logits[:, -1], *got[1].logits], [ref[0].logits[:, -1], *ref[1].logits]):
        scale = max(1.0, b.float().abs().amax().item())
        assert (a.float() - b.float()).abs().amax().item() <= TOL[dtype] * scale


@pytest.mark.skipif(not _has_flash(), reason="needs flash_attn (FlashAttention-2)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lightkv_cover_under_flash_attention_2_on_cuda(dtype):
    model, batch = _model_and_batch(dtype)
    ref = _run(model, batch)  # sdpa: the bias on the mask
    model.config._attn_implementation = "flash_attention_2"
    try:
        got = _run(model, batch)  # the bias channel
    finally:
        model.config._attn_implementation = "sdpa"
    _close(ref, got, dtype)
    layers = got[0].cache.layers
    assert got[2] == {"flash_attention_2": len(layers)}
    assert all(layer.keys.shape[-1] == HEAD_DIM + 1 for layer in layers)


@pytest.mark.parametrize("route", ["channel", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_routes_under_sdpa_on_cuda(route, dtype):
    """The channel through sdpa's CUDA kernels, and compiled FlexAttention's score_mod."""
    model, batch = _model_and_batch(dtype)
    _close(_run(model, batch, "mask"), _run(model, batch, route), dtype)
