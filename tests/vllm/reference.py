"""What `lightkv.apply` keeps of each image in `transformers`, on the tiny model and the same
inputs as a vLLM engine run (its recorded encoder output), for the prompt-aware tests."""

from __future__ import annotations

import torch

import lightkv
from lightkv.config import PipelineConfig
from lightkv.graph.layout import TokenKind
from lightkv.integrations.vllm.question import question_ids

from .conftest import tiny

_MODELS: dict[str, object] = {}


def _model(model_dir):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    key = str(model_dir)
    if key not in _MODELS:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(key, dtype=torch.float32)
        _MODELS[key] = (model.eval(), AutoProcessor.from_pretrained(key))
    return _MODELS[key]


def pipeline(spec):
    return lightkv.load(spec) if isinstance(spec, str) else PipelineConfig.from_dict(spec).build()


def _inject(model, encoder, own):
    """Make ``model`` use ``encoder`` (per image ``[N, D]``) as its image features, keeping its
    own in ``own``; returns the original method (to restore)."""
    original = model.model.get_image_features

    def features(pixel_values, image_grid_thw=None, **kwargs):
        out = original(pixel_values, image_grid_thw, **kwargs)
        own.extend(t.detach().clone() for t in out.pooler_output)
        if encoder is not None:
            out.pooler_output = tuple(torch.as_tensor(e, dtype=torch.float32) for e in encoder)
        return out

    model.model.get_image_features = features
    return original


def generate(model_dir, spec, prompt, encoder, max_tokens):
    """Greedy tokens and the first step's log-probabilities ``[V]`` of `lightkv.apply` with
    ``spec`` in `transformers` (its default attention, the bias on the 4-D mask), on ``prompt``
    with ``encoder`` (vLLM's recorded encoder output) as the image features."""
    model, processor = _model(model_dir)
    text, images = tiny.request(prompt)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    _inject(model, encoder, [])
    try:
        with lightkv.apply(pipeline(spec), model), torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
    finally:
        del model.model.get_image_features
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, torch.log_softmax(out.scores[0][0].float(), -1)


def survivors(model_dir, spec, prompt, encoder=None):
    """Per image of ``prompt`` (a test prompt, `tiny.request`): ``(question ids, index, embeds,
    encoder)``: the question lightkv's adapter reads (text after the last image), the kept
    grid indices (ascending), their embeddings after the stage, and the model's own encoder
    output. ``encoder``: per image ``[N, D]`` to use in place of the model's (vLLM's)."""
    model, processor = _model(model_dir)
    text, images = tiny.request(prompt)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    own: list[torch.Tensor] = []
    _inject(model, encoder, own)
    try:
        with lightkv.apply(pipeline(spec), model) as session, torch.no_grad():
            model(**inputs)
        result = session.records[0].result
    finally:
        del model.model.get_image_features
    ids = inputs["input_ids"][0]
    image_token = tiny.vocab()["<|image_pad|>"]
    question = question_ids(ids.tolist(), image_token)
    pads = torch.nonzero(ids == image_token).flatten().tolist()
    origin, kind = result.layout.origin[0], result.layout.kind[0]
    out, at = [], 0
    for j, (rows, cols) in enumerate(prompt["images"]):
        start = pads[at]
        mask = (kind == int(TokenKind.VISION)) & (origin >= start) & (origin < start + rows * cols)
        order = torch.argsort(origin[mask])
        out.append((question, (origin[mask] - start)[order], result.hidden[0][mask][order], own[j]))
        at += rows * cols
    return out
