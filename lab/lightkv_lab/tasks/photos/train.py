"""Training the Photos model's projector and decoder from cached tower features
(``python -m lightkv_lab.tasks.train qa --task photos ...``; `lightkv_lab.tasks.train` hands
the ``photos`` task to `run`).

The tower never runs in the training loop: the features of a fixed training image set
(``--images`` layouts of the ``train`` stream) and of a held-out set come from
`features.cached_features`, computed once and reused by every rerun. Each step draws
``--batch`` images and ``--questions`` fresh questions about each (types drawn by ``--mix``,
default uniform), writes the projected features into the ``<image>`` positions of the
embedded prompt, and trains the projector (initialised from the features' statistics,
`init_projector`) and every decoder layer (word embeddings fixed,
N(0, 1) and tied, as the other tasks do; ``--mimetic`` as there). With ``--aux W`` an
auxiliary cross-entropy teaches each projected token to name what its patch shows (the
object's colour and kind, or the background's category), weighted ``W``.

The checkpoint ``--out/qa.pt`` (trained part, optimiser, random states, log; written
atomically every ``--ckpt-every`` steps) makes a rerun continue; ``--export DIR`` writes the
Hugging Face directory at the end (without the tower's weights). Held-out evaluation in the
log is teacher-forced exact match per question type (single-word answers: the greedy answer).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightkv.outputs import write_atomic
from lightkv_lab.tasks.batching import left_pad
from lightkv_lab.tasks.photos import data
from lightkv_lab.tasks.photos.features import cached_features, image_set
from lightkv_lab.tasks.photos.layout import SIDE, patches, sign_patches
from lightkv_lab.tasks.photos.model import PhotosSpec, build_model, save, trained_state

__all__ = ["embed_rows", "init_projector", "patch_labels", "rows_for", "run"]

IGNORE = -100
N_IMG = SIDE * SIDE
HELDOUT_SEED = 0


def rows_for(scenes) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``labels`` of one row per image:
    ``<bos> <image>*256 <sep> q1 a1 <eos> q2 a2 <eos> ...`` (answers labelled), left-padded."""
    rows, labels = [], []
    for scene in scenes:
        row = [data.BOS_ID] + [data.IMAGE_ID] * N_IMG + [data.SEP_ID]
        lab = [IGNORE] * len(row)
        for ep in scene:
            q, a = data.encode(ep.question), data.encode(ep.answer) + [data.EOS_ID]
            row += q + a
            lab += [IGNORE] * len(q) + a
        rows.append(row)
        labels.append(lab)
    return left_pad(rows, labels)


def embed_rows(model, batch: dict, features: torch.Tensor) -> torch.Tensor:
    """``[B, L, D]`` input embeddings with the projected ``features [B, 256, 384]`` in the
    ``<image>`` positions (what ``LlavaModel`` does with ``pixel_values``)."""
    emb = model.get_input_embeddings()(batch["input_ids"])
    img = model.model.multi_modal_projector(features.to(emb.dtype))
    mask = (batch["input_ids"] == data.IMAGE_ID)[..., None]
    return emb.masked_scatter(mask, img)


def patch_labels(layout) -> torch.Tensor:
    """int64 ``[2, 256]``: per patch the word it shows (an object's or dot's colour, else the
    background's category; ignored on the sign) and its object's kind (ignored elsewhere)."""
    what = torch.full((SIDE, SIDE), data.WORD_TO_ID[layout.scene])
    kind = torch.full((SIDE, SIDE), IGNORE)
    for d in layout.dots:
        what[patches(layout, dots=[d])] = data.WORD_TO_ID[d.colour]
    for ob in sorted(layout.objects, key=lambda o: -o.size):  # small ones on top
        m = patches(layout, [ob])
        what[m] = data.WORD_TO_ID[ob.colour]
        kind[m] = data.WORD_TO_ID[ob.kind]
    sign = sign_patches(layout)
    what[sign] = IGNORE
    kind[sign] = IGNORE
    return torch.stack([what.reshape(-1), kind.reshape(-1)])


@torch.no_grad()
def init_projector(model, features: torch.Tensor, seed: int = 0) -> None:
    """Data-dependent initialisation of LLaVA's projector (``Linear -> GELU -> Linear``, the
    architecture unchanged): the first layer standardises each feature dimension (its mean
    and standard deviation over ``features [n, N, 384]`` folded into the weights) before a
    random unit-variance projection, the second keeps unit variance, so projected tokens start
    at the scale of the N(0, 1) word embeddings instead of ~60x below it (the default 0.02
    initialisation), where a per-patch loss against those embeddings learns slowly."""
    proj = model.model.multi_modal_projector
    x = features.reshape(-1, features.shape[-1]).float()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-3)
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out = proj.linear_1.in_features, proj.linear_1.out_features
    w1 = torch.randn(d_out, d_in, generator=gen) / d_in**0.5 / std[None, :]
    proj.linear_1.weight.copy_(w1)
    proj.linear_1.bias.copy_(-(w1 @ mean))
    d2 = proj.linear_2.in_features
    # GELU of a unit normal has second moment ~0.43: scale so the output has unit variance
    proj.linear_2.weight.copy_(
        torch.randn(proj.linear_2.weight.shape, generator=gen) / (0.43 * d2) ** 0.5
    )
    proj.linear_2.bias.zero_()


def _aux_loss(model, projected: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    emb = model.get_input_embeddings().weight
    logits = projected @ emb.T / emb.shape[1] ** 0.5  # [B, N, V]
    return sum(
        F.cross_entropy(logits.flatten(0, 1), labels[:, g].flatten(), ignore_index=IGNORE)
        for g in range(labels.shape[1])
    )


def _draw(rng, layouts, n_images: int, n_questions: int, qtypes, weights):
    """``(indices, scenes)``: ``n_images`` distinct images (drawn again where none of
    ``qtypes`` can be asked, e.g. ``relation`` without a pair apart along one axis) with
    ``n_questions`` questions each."""
    idx, scenes = [], []
    for i in rng.sample(range(len(layouts)), len(layouts)):
        try:
            scenes.append(data.episodes_for(rng, layouts[i], n_questions, qtypes, weights))
        except ValueError:
            continue
        idx.append(i)
        if len(idx) == n_images:
            return idx, scenes
    raise ValueError(f"fewer than {n_images} of {len(layouts)} images can be asked {qtypes}")


@torch.no_grad()
def evaluate(model, layouts, features, n_per_type: int, seed: int = 4321) -> dict:
    """Teacher-forced exact match per question type on held-out images."""
    model.eval()
    result = {}
    for qtype in data.QTYPES:
        rng = random.Random(f"photos-eval:{seed}:{qtype}")
        idx, scenes = _draw(rng, layouts, n_per_type, 1, (qtype,), None)
        batch = rows_for(scenes)
        emb = embed_rows(model, batch, features[idx].float())
        logits = model(inputs_embeds=emb, attention_mask=batch["attention_mask"]).logits
        pred = logits[:, :-1].argmax(-1)
        gold = batch["labels"][:, 1:]
        ok = ((pred == gold) | (gold == IGNORE)).all(-1)
        result[qtype] = float(ok.float().mean())
    model.train()
    return result


def _mix(args) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    if not args.mix:
        return data.QTYPES, None
    names, weights = [], []
    for item in args.mix:
        name, _, w = item.partition("=")
        if name not in data.QTYPES:
            raise SystemExit(f"--mix: {name!r} is not a Photos question type ({data.QTYPES})")
        names.append(name)
        weights.append(float(w) if w else 1.0)
    return tuple(names), tuple(weights)


def run(args) -> None:
    """The ``qa`` (and ``export``) stage of the Photos model; see the module docstring."""
    from tqdm import tqdm

    from lightkv_lab.tasks.photos.recency import install_recency_prior, prior_params
    from lightkv_lab.tasks.train_init import mimetic_init

    if args.stage not in ("qa", "export"):
        raise SystemExit(f"the photos task trains in one stage, qa (got {args.stage!r})")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "qa.pt"
    state = None
    if args.stage == "export":
        if not ckpt.exists():
            raise SystemExit(f"export reads {ckpt}, which does not exist: run the qa stage first")
        state = torch.load(ckpt, weights_only=False)
        # the checkpoint's own sizes and prior, whatever this call's flags say
        here = {k: getattr(args, k) for k in ("stage", "out", "export", "threads")}
        args = argparse.Namespace(**{**vars(args), **state["args"], **here})
    recency = getattr(args, "recency_layers", 0)
    spec = PhotosSpec(
        text_width=args.text_width,
        text_layers=args.text_layers,
        text_ffn=args.text_ffn or 4 * args.text_width,
        rope_theta=args.rope_theta,
        attention_bias=recency > 0,
    )
    # the tower's weights are not needed here: features come from the cache (which builds the
    # package's tower itself when a shard is missing) and the checkpoint holds no tower
    model = build_model(spec, seed=args.seed, tower=False)
    init_from = getattr(args, "init_from", None)
    if init_from and not ckpt.exists() and not Path(init_from).is_file():
        raise SystemExit(f"--init-from {init_from}: no such checkpoint (run the first qa stage)")
    if recency and not getattr(args, "recency_strength", 0):
        raise SystemExit("--recency-layers needs --recency-strength (the prior's logit range)")
    if state is not None:  # the export stage
        model.load_state_dict(state["model"], strict=False)
        save(model, args.export, spec, {"train": state["args"], "step": state["step"]})
        print(f"exported step {state['step']} to {args.export}")
        return
    cache = Path(args.cache)
    say = lambda done, n: print(f"features {done}/{n}", flush=True)  # noqa: E731
    train_layouts = image_set("train", args.seed, args.images)
    heldout_layouts = image_set("heldout", HELDOUT_SEED, 256)
    train = cached_features(train_layouts, cache, progress=say)["features"]
    heldout = cached_features(heldout_layouts, cache, progress=say)["features"]
    labels = torch.stack([patch_labels(lay) for lay in train_layouts]) if args.aux else None
    if init_from and not ckpt.exists():
        # fine-tuning: the trained part of an earlier run (no attention biases), then the prior
        model.load_state_dict(torch.load(init_from, weights_only=False)["model"], strict=False)
    elif args.mimetic:
        mimetic_init(model, seed=args.seed)
    if not ckpt.exists() and not init_from:
        init_projector(model, train[: min(len(train), 256)], args.seed)
    fixed: set[int] = set()
    if recency:
        if not ckpt.exists():
            install_recency_prior(model, recency, args.recency_strength)
        fixed = prior_params(model)
    for p in model.parameters():
        p.requires_grad_(False)
    emb = model.get_input_embeddings().weight
    params = [
        p
        for m in (model.model.multi_modal_projector, model.model.language_model)
        for p in m.parameters()
        if p is not emb and id(p) not in fixed
    ]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    rng = random.Random(f"photos-train:{args.seed}")
    step, log = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        step, log = state["step"], state["log"]
        print(f"resumed {ckpt} at step {step}", flush=True)

    def checkpoint() -> None:
        state = {
            "model": trained_state(model),
            "opt": opt.state_dict(),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "log": log,
            "args": vars(args),
        }
        write_atomic(ckpt, lambda f: torch.save(state, f))

    qtypes, weights = _mix(args)
    until = min(args.steps, args.until or args.steps)
    bar = tqdm(total=args.steps, initial=step, desc="qa", mininterval=30, dynamic_ncols=True)
    t0, running = time.time(), None
    model.train()
    while step < until:
        warm = min(1.0, (step + 1) / args.warmup)
        scale = warm * (0.1 + 0.9 * max(0.0, 1 - step / args.steps)) if args.decay else warm
        for g in opt.param_groups:
            g["lr"] = args.lr * scale
        idx, scenes = _draw(rng, train_layouts, args.batch, args.questions, qtypes, weights)
        batch = rows_for(scenes)
        feats = train[idx].float()
        inputs = embed_rows(model, batch, feats)
        loss = model(
            inputs_embeds=inputs, attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss
        if labels is not None:
            projected = model.model.multi_modal_projector(feats)
            loss = loss + args.aux * _aux_loss(model, projected, labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        running = value if running is None else 0.98 * running + 0.02 * value
        bar.update(1)
        if step % args.eval_every == 0 or step == until:
            ev = evaluate(model, heldout_layouts, heldout, args.eval_n)
            entry = {"step": step, "loss": running, "minutes": (time.time() - t0) / 60, **ev}
            log.append(entry)
            bar.write(json.dumps(entry))
            sys.stdout.flush()  # a log file sees each evaluation as it happens
        if step % args.ckpt_every == 0 or step == until:
            checkpoint()
    bar.close()
    if args.export and step >= args.steps:
        save(model, args.export, spec, {"train": vars(args), "step": step, "log": log[-1:]})
        print(f"exported to {args.export}")
