"""On a GPU (marked ``cuda``; skipped without one, run by ``benchmarks/gpu_check.sh``):
identity exact, bf16 / fp16 compression agreeing with the float32 CPU run, rows
independent of their batch, and the projection tap equal to a second projection."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply

from .conftest import assert_rows_match_batch, identity_pipeline, tiny_lightkv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these)",
    ),
]
FAMILIES = ["llava", "llava_next", "qwen2_5_vl", "gemma3", "idefics3"]
GEN = {
    "max_new_tokens": 4,
    "do_sample": False,
    "output_logits": True,
    "return_dict_in_generate": True,
}


def _on(batch: dict, device, dtype) -> dict:
    return {
        k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def _pair(family: str, dtype: torch.dtype):
    """The float32 CPU model and its copy on the GPU in ``dtype`` (rows are built on the CPU
    one: some families' row builders run the vision tower)."""
    cpu = TINY_MODELS[family].build(attn_implementation="sdpa").eval()
    gpu = TINY_MODELS[family].build(attn_implementation="sdpa").eval()
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu.to(device="cuda", dtype=dtype)


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Logit tolerance of a pipeline that removes nothing, relative to the largest logit: its
layers attend under an explicit 4-D mask, which may pick another SDPA kernel than the
model's own causal path (on the CPU, float32 agrees to 1e-5)."""


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_identity_on_cuda(family, dtype):
    """Removing nothing: the same tokens; text-only rows bit-exact (no hook changes them)."""
    fam = TINY_MODELS[family]
    cpu, model = _pair(family, dtype)
    batch = _on(fam.collate(fam.examples(cpu)), "cuda", dtype)
    ref = model.generate(**batch, **GEN)
    with apply(identity_pipeline(), model, **fam.adapter_options):
        same = model.generate(**batch, **GEN)
    assert torch.equal(same.sequences, ref.sequences)
    for a, b in zip(same.logits, ref.logits):
        assert (a.float() - b.float()).abs().amax().item() <= TOL[dtype] * max(
            1.0, b.float().abs().amax().item()
        )
    text = _on(fam.collate([fam.row(cpu, images=0, pre=3, post=4, seed=5)]), "cuda", dtype)
    ref_text = model.generate(**text, **GEN)
    with apply(tiny_lightkv(), model, **fam.adapter_options):
        out_text = model.generate(**text, **GEN)
    assert torch.equal(out_text.sequences, ref_text.sequences)
    for a, b in zip(out_text.logits, ref_text.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_on_cuda_follows_float32_on_cpu(family, dtype):
    """The same weights: lightkv in half precision on the GPU keeps the same token counts as
    float32 on the CPU and its answer logits stay close (bf16 / fp16 rounding, 4 layers)."""
    fam = TINY_MODELS[family]
    cpu, gpu = _pair(family, dtype)
    rows = fam.examples(cpu)
    with torch.no_grad():
        with apply(tiny_lightkv(), cpu, **fam.adapter_options) as s_cpu:
            want = cpu(**fam.collate(rows)).logits
        with apply(tiny_lightkv(), gpu, **fam.adapter_options) as s_gpu:
            got = gpu(**_on(fam.collate(rows), "cuda", dtype)).logits
    assert [lay.tokens for lay in s_gpu.report().layers] == [
        lay.tokens for lay in s_cpu.report().layers
    ]
    # the answer position (every row's last column): vision columns may merge other pairs
    # where half precision reorders two near-equal similarities
    last_want, last_got = want[:, -1], got[:, -1].float().cpu()
    assert (last_got - last_want).abs().amax().item() <= 0.05 * last_want.abs().amax().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_are_independent_on_cuda(family):
    fam = TINY_MODELS[family]
    cpu, model = _pair(family, torch.float32)
    rows = fam.examples(cpu)
    batch = _on(fam.collate(rows), "cuda", torch.float32)

    class OnCuda:  # the row-alone collation, moved to the GPU
        @staticmethod
        def collate(r):
            return _on(fam.collate(r), "cuda", torch.float32)

    with torch.no_grad(), apply(tiny_lightkv(), model, **fam.adapter_options):
        assert_rows_match_batch(model, OnCuda, batch, rows, GEN, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_tap_equals_second_projection_on_cuda(family):
    fam = TINY_MODELS[family]
    cpu, model = _pair(family, torch.bfloat16)
    batch = _on(fam.collate(fam.examples(cpu)), "cuda", torch.bfloat16)
    with torch.no_grad():
        with apply(tiny_lightkv(), model, record=True, **fam.adapter_options) as tapped:
            a = model(**batch).logits
        with apply(
            tiny_lightkv(), model, record=True, reuse_projections=False, **fam.adapter_options
        ) as projected:
            b = model(**batch).logits
    assert all(r.tapped for r in tapped.records)
    for x, y in zip(tapped.records, projected.records, strict=True):
        torch.testing.assert_close(x.relevance, y.relevance, rtol=2e-2, atol=1e-3)
    assert a.shape == b.shape


def test_graph_decoding_refused_in_a_session_and_exact_after_it():
    """CUDA graphs need a static cache, which a compressed prefill cannot fill (every layer its
    own length and holes, one shared decoding mask): inside a session it is refused with the
    reason; after the session the same model decodes with a static cache compiled into CUDA
    graphs ("reduce-overhead") and gives the tokens of eager dynamic-cache decoding."""
    from transformers import CompileConfig

    fam = TINY_MODELS["llava"]
    _cpu, model = _pair("llava", torch.float32)
    batch = _on(fam.collate([fam.row(_cpu, seed=3)]), "cuda", torch.float32)
    gen = {"max_new_tokens": 8, "do_sample": False}
    eager = model.generate(**batch, **gen)
    with apply(tiny_lightkv(), model):
        with pytest.raises(TypeError, match="one decoding mask.*CUDA graphs"):
            model.generate(**batch, **gen, cache_implementation="static")
        assert (
            model.generate(**batch, **gen).shape == eager.shape
        )  # the dynamic cache decodes compressed
    graphs = model.generate(
        **batch,
        **gen,
        cache_implementation="static",
        compile_config=CompileConfig(mode="reduce-overhead", fullgraph=False),
    )
    assert torch.equal(graphs, eager)
