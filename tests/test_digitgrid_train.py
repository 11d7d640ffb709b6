"""The DigitGrid training script: seeded, resumable, exports a loadable model (tiny sizes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tqdm")

from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks.train import main

TINY = [
    "--text-width",
    "32",
    "--text-layers",
    "2",
    "--text-ffn",
    "64",
    "--vision-width",
    "32",
    "--vision-layers",
    "1",
    "--batch",
    "2",
    "--questions",
    "2",
    "--eval-n",
    "1",
    "--threads",
    "1",
    "--glyphs",
    "colour",
    "--warmup",
    "1",
    "--eval-every",
    "1000",
]


def _weights(path):
    return torch.load(path, weights_only=False)["model"]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_is_seeded_and_resumes_exactly(tmp_path, capsys):
    main(["align", "--out", str(tmp_path / "a"), "--steps", "2", *TINY])
    main(["align", "--out", str(tmp_path / "b"), "--steps", "2", *TINY])
    assert _same(_weights(tmp_path / "a" / "align.pt"), _weights(tmp_path / "b" / "align.pt"))

    # 2 steps, then resume to 3 == 3 steps straight
    main(["align", "--out", str(tmp_path / "b"), "--steps", "3", *TINY])
    assert "resumed" in capsys.readouterr().out
    main(["align", "--out", str(tmp_path / "c"), "--steps", "3", *TINY])
    assert _same(_weights(tmp_path / "b" / "align.pt"), _weights(tmp_path / "c" / "align.pt"))
    assert not _same(_weights(tmp_path / "a" / "align.pt"), _weights(tmp_path / "c" / "align.pt"))


def test_qa_stage_keeps_the_aligned_tower_and_exports(tmp_path):
    out = tmp_path / "run"
    main(["align", "--out", str(out), "--steps", "1", *TINY])
    export = tmp_path / "model"
    main(["qa", "--out", str(out), "--steps", "2", "--mimetic", "--export", str(export), *TINY])
    aligned = _weights(out / "align.pt")
    trained = _weights(out / "qa.pt")
    frozen = [
        k
        for k in aligned
        if k.startswith(
            (
                "model.vision_tower.",
                "model.multi_modal_projector.",
                "model.language_model.embed_tokens.",
            )
        )
    ]
    assert frozen and all(torch.equal(aligned[k], trained[k]) for k in frozen)
    decoder = [k for k in trained if k.startswith("model.language_model.layers.")]
    assert any(not torch.equal(aligned[k], trained[k]) for k in decoder)

    model, processor, grid = dg.load(export)
    assert grid.glyphs == "colour"
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in decoder)
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id


def test_alignment_targets_name_each_cell():
    from lightkv_lab.tasks.digitgrid.data import WORD_TO_ID

    model = dg.build_model(
        dg.ModelSpec(text_width=32, text_layers=1, text_ffn=32, vision_width=32, vision_layers=1)
    )
    grid = torch.tensor([[[3, -1], [-1, 0]]])  # 2x2 cells
    t = alignment = dg.alignment_targets(model, grid, patch=4, cell=8)  # 2x2 tokens per cell
    assert alignment.shape == (1, 16, 32)
    e = model.get_input_embeddings().weight
    img = e[WORD_TO_ID["<image>"]]
    t = t.reshape(4, 4, 32)
    assert torch.allclose(t[0, 0], img + e[WORD_TO_ID["three"]] + e[WORD_TO_ID["r1c1"]])
    assert torch.allclose(t[1, 3], img + e[WORD_TO_ID["none"]] + e[WORD_TO_ID["r1c2"]])
    assert torch.allclose(t[3, 3], img + e[WORD_TO_ID["zero"]] + e[WORD_TO_ID["r2c2"]])
    assert torch.equal(t[2, 2], t[3, 3])  # all tokens of a cell share its target


SCENES = ["--task", "scenes", *[a for a in TINY if a not in ("--glyphs", "colour")]]


def test_scenes_align_and_qa_resume_exactly_and_export(tmp_path, capsys):
    """The Scenes recipe's two stages on tiny sizes: qa for 2 steps then resumed to 3 equals
    3 steps straight; the export is a Scenes model directory."""
    main(["align", "--out", str(tmp_path / "a"), "--steps", "2", *SCENES])
    aligned = _weights(tmp_path / "a" / "align.pt")
    for run in ("b", "c"):
        (tmp_path / run).mkdir()
        torch.save(
            torch.load(tmp_path / "a" / "align.pt", weights_only=False), tmp_path / run / "align.pt"
        )
    main(["qa", "--out", str(tmp_path / "b"), "--steps", "2", "--mimetic", *SCENES])
    main(["qa", "--out", str(tmp_path / "b"), "--steps", "3", "--mimetic", *SCENES])
    assert "resumed" in capsys.readouterr().out
    main(["qa", "--out", str(tmp_path / "c"), "--steps", "3", "--mimetic", *SCENES])
    assert _same(_weights(tmp_path / "b" / "qa.pt"), _weights(tmp_path / "c" / "qa.pt"))
    assert not _same(aligned, _weights(tmp_path / "c" / "qa.pt"))
    main(["export", "--out", str(tmp_path / "c"), "--export", str(tmp_path / "m")])
    assert dg.read_task(tmp_path / "m").name == "scenes"
    assert dg.read_grid_config(tmp_path / "m").grid == 16


def test_scenes_tune_starts_from_qa_and_resumes_exactly(tmp_path, capsys):
    """``tune`` continues the decoder from ``qa.pt`` with a weighted question mix; it needs
    ``qa.pt``, resumes exactly, and ``export`` then prefers ``tune.pt``."""
    with pytest.raises(SystemExit, match="run the qa stage first"):
        main(["tune", "--out", str(tmp_path / "none"), "--steps", "1", *SCENES])
    main(["qa", "--out", str(tmp_path / "q"), "--steps", "1", "--mimetic", *SCENES])
    mix = ["--mix", "texture", "count=3", "relation=2"]
    for run in ("b", "c"):
        (tmp_path / run).mkdir()
        torch.save(
            torch.load(tmp_path / "q" / "qa.pt", weights_only=False), tmp_path / run / "qa.pt"
        )
    main(["tune", "--out", str(tmp_path / "b"), "--steps", "2", *mix, *SCENES])
    main(["tune", "--out", str(tmp_path / "b"), "--steps", "3", *mix, *SCENES])
    assert "resumed" in capsys.readouterr().out
    main(["tune", "--out", str(tmp_path / "c"), "--steps", "3", *mix, *SCENES])
    tuned = _weights(tmp_path / "c" / "tune.pt")
    assert _same(_weights(tmp_path / "b" / "tune.pt"), tuned)
    assert not _same(_weights(tmp_path / "c" / "qa.pt"), tuned)
    main(["export", "--out", str(tmp_path / "c"), "--export", str(tmp_path / "m")])
    model, _, _ = dg.load(tmp_path / "m")
    assert _same(model.state_dict(), tuned)
    with pytest.raises(SystemExit, match="not a question type"):
        main(["tune", "--out", str(tmp_path / "c"), "--steps", "4", "--mix", "colour", *SCENES])
