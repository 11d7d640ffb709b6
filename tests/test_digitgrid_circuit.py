"""The trainer's ``--circuit`` initialisation on an untrained model: with vision tokens that
carry exactly the align stage's target, the retrieval heads answer `what` questions and
count, before any training, and `freeze` keeps them where they were built."""

from __future__ import annotations

import random

import pytest
import torch
from lightkv_lab.tasks import circuit
from lightkv_lab.tasks.labels import translation
from lightkv_lab.tasks.model import ModelSpec, build_model
from lightkv_lab.tasks.symbolgrid import data as sg

GRID = sg.GridConfig()
SPEC = ModelSpec(
    patch=4,
    text_layers=4,
    text_head_dim=64,
    text_ffn=64,
    vision_layers=1,
    vision_width=32,
    rope_theta=1e8,
)
LAYER = 1


def _vision(model, grids: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B, 256, D]``: what the align stage teaches the projector, exactly."""
    emb = model.get_input_embeddings().weight.detach()
    cells = torch.tensor([sg.WORD_TO_ID[sg.cell_word(r, c)] for r in range(16) for c in range(16)])
    sym = emb[torch.tensor(sg.CONTENT_IDS)[grids.flatten(1)]]
    return emb[sg.IMAGE_ID] + (sym + emb[cells]) @ m.T


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    model = build_model(SPEC, GRID, seed=0, task="symbolgrid")
    circuit.structure_embeddings(model, sg, seed=0)
    m = translation(SPEC.text_width, 0)
    rng = random.Random(0)
    grids = torch.stack([sg.make_grid(rng, "train", GRID)[0] for _ in range(8)])
    with torch.no_grad():
        for i, layer in enumerate(model.model.language_model.layers):  # every other layer a no-op
            if i != LAYER:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    heads = circuit.install(
        model,
        sg,
        16,
        _vision(model, grids, m).flatten(0, 1),
        grids.flatten(),
        circuit.CircuitSpec(layer=LAYER),
    )
    return model.eval(), m, heads


def _run(model, m, episodes):
    emb = model.get_input_embeddings()
    rows = []
    for ep in episodes:
        words = torch.tensor([sg.WORD_TO_ID[w] for w in ep.question])
        rows.append(
            torch.cat(
                [
                    emb.weight[[sg.BOS_ID]],
                    _vision(model, ep.grid[None], m)[0],
                    emb.weight[[sg.SEP_ID]],
                    emb(words),
                ]
            )
        )
    with torch.no_grad():
        out = model.model.language_model(
            inputs_embeds=torch.stack(rows)
        )  # same length per question type
        return model.lm_head(out.last_hidden_state[:, -1])


def test_cell_words_are_row_plus_column():
    model = build_model(SPEC, GRID, seed=0, task="symbolgrid")
    circuit.structure_embeddings(model, sg, seed=0)
    e = model.get_input_embeddings().weight
    w = lambda r, c: e[sg.WORD_TO_ID[sg.cell_word(r, c)]]
    assert torch.allclose(w(2, 3) - w(2, 5), w(7, 3) - w(7, 5), atol=1e-5)
    assert torch.equal(model.lm_head.weight, e)  # still tied


def test_invariant_dims_are_the_slow_half_of_rope():
    dims = circuit.invariant_dims(64)
    assert dims.tolist() == list(range(16, 32)) + list(range(48, 64))
    inv_freq = 1.0 / (1e8 ** (torch.arange(0, 64, 2).float() / 64))
    assert (inv_freq[dims % 32] * 300).max() < 0.05  # under 0.05 rad across 300 positions


def test_the_cell_head_answers_what_questions_at_initialisation(built):
    model, m, _ = built
    rng = random.Random(5)
    eps = [sg.make_episode(rng, "heldout", "what", GRID) for _ in range(32)]
    got = _run(model, m, eps).argmax(-1)
    want = torch.tensor([sg.WORD_TO_ID[e.answer[0]] for e in eps])
    assert (got == want).float().mean() == 1.0


def test_the_symbol_heads_count(built):
    model, m, _ = built
    attn = model.model.language_model.layers[LAYER].self_attn
    seen = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("x", a[0][:, -1]))
    rng = random.Random(6)
    eps = [sg.make_episode(rng, "heldout", "count", GRID) for _ in range(48)]
    _run(model, m, eps)
    hook.remove()
    n = torch.tensor([int(e.answer[0][1:]) for e in eps]).float()
    f = seen["x"][:, 2 * attn.head_dim]  # the second symbol head's output
    means = [float(f[n == k].mean()) for k in range(6) if (n == k).any()]
    assert means == sorted(means) and len(means) >= 4  # grows with the count
    assert f[n == 0].max() < f[n >= 1].min()  # absent vs present never overlap


def test_freeze_keeps_the_built_heads(built):
    model, _, heads = built
    attn = model.model.language_model.layers[LAYER].self_attn
    fresh = build_model(SPEC, GRID, seed=0, task="symbolgrid")
    fresh.load_state_dict(model.state_dict())
    circuit.freeze(fresh, LAYER, heads)
    fresh.train()
    out = fresh(
        input_ids=torch.tensor([[sg.BOS_ID, sg.SEP_ID, sg.WORD_TO_ID["what"]]]),
        labels=torch.tensor([[-100, sg.SEP_ID, sg.EOS_ID]]),
    )
    out.loss.backward()
    a = fresh.model.language_model.layers[LAYER].self_attn
    rows = slice(0, len(heads) * attn.head_dim)
    for proj in (a.q_proj, a.k_proj, a.v_proj):
        assert (
            proj.weight.grad[rows].abs().max() == 0
            and proj.weight.grad[rows.stop :].abs().max() > 0
        )
    assert a.o_proj.weight.grad[:, rows].abs().max() == 0
