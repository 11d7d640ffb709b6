"""`lightkv generate` end to end on a tiny random LLaVA saved with an offline processor."""

from __future__ import annotations

import json

import pytest

from lightkv.cli import main

pytest.importorskip("PIL")
pytest.importorskip("tokenizers")

CONFIG = """\
name: tiny
schedule:
  layers: [1, 2]
  windows_per_side: [2, 1]
  removal_ratios: [0.5]
partitioner: grid
scorer: cosine
pruner: divergence
passer: relevance_mean
relevance: query_softmax
"""


def _processor(model):
    """A LlavaProcessor built offline: word-level tokenizer + CLIP image processor sized
    for the tiny vision tower."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast

    try:  # transformers 5 without torchvision: the PIL backend, without a fallback warning
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover - other transformers versions
        from transformers import CLIPImageProcessor as ImageProcessor

    from lightkv.testing import IMAGE

    cfg = model.config
    specials = {
        "<pad>": cfg.text_config.pad_token_id,
        "<s>": cfg.text_config.bos_token_id,
        "</s>": cfg.text_config.eos_token_id,
        "<image>": IMAGE,
    }
    words = ["<unk>", "USER", "ASSISTANT", ":", "what", "is", "this", "?", "a", "cat"]
    vocab = dict(specials)
    free = (i for i in range(cfg.text_config.vocab_size) if i not in specials.values())
    for w in words:
        vocab[w] = next(free)
    for i in free:  # name the rest so every id the random model emits decodes
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))  # "<image><image>..." must split into image tokens
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    side = cfg.vision_config.image_size
    images = ImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    # CLIP adds one CLS token that the "default" strategy drops: (side / patch)^2 image tokens
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=cfg.vision_config.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from lightkv_lab.tiny import TINY_MODELS
    from PIL import Image

    from lightkv.testing import IMAGE

    root = tmp_path_factory.mktemp("generate")
    model = TINY_MODELS["llava"].build()
    proc = _processor(model)
    model_dir = root / "tiny-llava"
    model.save_pretrained(model_dir)
    proc.save_pretrained(model_dir)
    image = root / "image.png"
    Image.new("RGB", (40, 30), (200, 120, 40)).save(image)
    # the processor inserts as many image tokens as the model expects
    vc = model.config.vision_config
    ids = proc(
        images=Image.open(image),
        text="USER: <image>\nwhat is this? ASSISTANT:",
        return_tensors="pt",
    )["input_ids"]
    assert int((ids == IMAGE).sum()) == (vc.image_size // vc.patch_size) ** 2
    config = root / "tiny.yaml"
    config.write_text(CONFIG)
    return {"model": str(model_dir), "image": str(image), "config": str(config), "root": root}


def _gen(assets, *extra):
    return [
        "generate",
        "--model",
        assets["model"],
        "--image",
        assets["image"],
        "--prompt",
        "what is this?",
        *extra,
    ]


def test_generate_compare_end_to_end(assets, capsys):
    code = main(_gen(assets, "--config", assets["config"], "--compare", "--max-new-tokens", "3"))
    out, err = capsys.readouterr()
    assert code == 0, err
    for needle in (
        "answer (lightkv):",
        "answer (baseline):",
        "answers identical:",
        "kept vision fraction (avg over layers): 0.",
        "vision KV bytes:",
        "total KV bytes:",
        "time to first token:",
        "generate time:",
        "stage after layer 1: vision tokens 64 -> 32",
        "stage after layer 2: vision tokens 32 -> 16",
        "pipeline: tiny",
        "(llava, LlavaForConditionalGeneration",
    ):
        assert needle in out, (needle, out)
    assert "without" in out.split("time to first token:")[1].splitlines()[0]


def test_generate_json_without_compare(assets, capsys):
    code = main(_gen(assets, "--config", assets["config"], "--max-new-tokens", "2", "--json"))
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["baseline"] is None
    assert data["compressed"]["new_tokens"] <= 2
    # 4 layers: 64, 64, 32, 16 vision tokens -> 176 / 256
    assert data["kept_vision_fraction"] == pytest.approx(176 / 256)
    assert data["kv_bytes_vision"] < data["kv_bytes_vision_baseline"]


def _one_line_error(code, capsys, *needles):
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightkv: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_image(assets, capsys):
    args = _gen(assets, "--config", assets["config"])
    args[args.index("--image") + 1] = str(assets["root"] / "nope.png")
    _one_line_error(main(args), capsys, "nope.png", "not found")


def test_unreadable_image(assets, capsys):
    bad = assets["root"] / "bad.png"
    bad.write_text("not an image")
    args = _gen(assets, "--config", assets["config"])
    args[args.index("--image") + 1] = str(bad)
    _one_line_error(main(args), capsys, "bad.png", "cannot read the image")


def test_unknown_preset(assets, capsys):
    _one_line_error(main(_gen(assets, "--preset", "lightkvv")), capsys, "lightkvv", "presets:")


def test_missing_config_file(assets, capsys):
    _one_line_error(
        main(_gen(assets, "--config", str(assets["root"] / "missing.yaml"))), capsys, "missing.yaml"
    )


def test_missing_model_dir(assets, capsys):
    args = _gen(assets, "--config", assets["config"])
    args[args.index("--model") + 1] = str(assets["root"] / "no-such-model")
    _one_line_error(main(args), capsys, "no-such-model", "model directory not found")


def test_directory_without_model(assets, capsys):
    args = _gen(assets, "--config", assets["config"])
    args[args.index("--model") + 1] = str(assets["root"])
    _one_line_error(main(args), capsys, "no config.json")


def test_unsupported_family(assets, tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    ).save_pretrained(tmp_path)
    args = _gen(assets, "--config", assets["config"])
    args[args.index("--model") + 1] = str(tmp_path)
    _one_line_error(main(args), capsys, "'llama' is not supported", "supported families: llava")


def test_schedule_deeper_than_model(assets, capsys):
    # the lightkv preset compresses after layer 12; the tiny model has 4 layers
    code = main(_gen(assets, "--preset", "lightkv", "--max-new-tokens", "1"))
    _, err = capsys.readouterr()
    assert code == 1, err
    assert "Traceback" not in err and err.startswith("lightkv: error: ")
    assert "only 4 layers" in err


def test_a_missed_target_is_reported_and_warned(assets, capsys, tmp_path):
    """Regression (issue 27, item 5): a budget the schedule cannot reach passed silently. Here
    the pre-LLM stage is asked to remove 80% with a parity split (at most half a window):
    the JSON carries target and achieved, and stderr says it missed, in one line."""
    config = tmp_path / "greedy.yaml"
    config.write_text(
        "name: greedy\nschedule:\n  name: pre_llm\n  params: {removal_ratio: 0.8, "
        "windows_per_side: 2}\npartitioner: grid\nscorer: cosine\npruner: divergence\npasser: "
        "relevance_mean\nrelevance: query_softmax\n"
    )
    code = main(_gen(assets, "--config", str(config), "--max-new-tokens", "1", "--json"))
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)  # stdout stays one JSON document
    assert data["kept_vision_fraction"] == pytest.approx(0.5)
    assert data["target_kept_fraction"] == pytest.approx(0.2)
    assert "kept 0.500 of the vision KV, not the 0.200 it targets" in data["missed_target"]
    warnings = [line for line in err.splitlines() if line.startswith("lightkv: warning: ")]
    assert len(warnings) == 1 and "not the 0.200 it targets" in warnings[0]
    code = main(_gen(assets, "--config", assets["config"], "--max-new-tokens", "1", "--json"))
    out, err = capsys.readouterr()
    assert json.loads(out)["missed_target"] is None and "warning" not in err  # on target: silent


# ---------------------------------------------------------------------------- issue 40 items 6, 7
def test_the_default_preset_fits_the_models_depth_and_says_so(assets, capsys):
    """A 4-layer model without --preset used to get ``lightkv`` (25+ layers) and an error."""
    code = main(_gen(assets, "--max-new-tokens", "1", "--repeats", "1", "--json"))
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["pipeline"] == "lightkv-budget"
    assert any("lightkv-budget (the default for this 4-layer decoder" in n for n in data["notes"])


def test_ttft_and_generate_time_come_from_the_same_calls(assets, capsys):
    code = main(
        _gen(
            assets,
            "--config",
            assets["config"],
            "--compare",
            "--max-new-tokens",
            "4",
            "--repeats",
            "3",
            "--json",
        )
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    for run in (data["compressed"], data["baseline"]):
        assert (
            run["repeats"] == 3 and 0 < run["ttft_s"] <= run["total_s"]
        )  # medians of the same calls
    code = main(
        _gen(assets, "--config", assets["config"], "--max-new-tokens", "2", "--repeats", "2")
    )
    out, _ = capsys.readouterr()
    assert (
        "median of 2 generate call(s) each; the first token and the whole call are timed in the "
        "same calls" in out
    )


def test_an_empty_image_path_is_named(assets, capsys):
    args = _gen(assets, "--config", assets["config"])
    args[args.index("--image") + 1] = ""
    _one_line_error(main(args), capsys, "--image is empty")


def test_repeats_are_bounded(assets, capsys):
    with pytest.raises(SystemExit):
        from lightkv.cli import parse_args

        parse_args(_gen(assets, "--repeats", "1000"))
    assert "at most 20" in capsys.readouterr().err
