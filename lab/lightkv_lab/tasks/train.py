"""Train a bundled LVLM on one of the tasks (``python -m lightkv_lab.tasks.train``).

Two stages and an optional third, each resumable from its checkpoint (``--out/<stage>.pt``,
written every ``--ckpt-every`` steps and at the end; a rerun with the same ``--out``
continues):

1. ``align``: the vision tower and projector alone learn to map every vision token to
   ``E[<image>] + E[content] + E[row] + E[column]`` (mean squared error; ``E`` is the
   decoder's frozen, N(0, 1) input embedding, see `alignment_targets`). The decoder does not
   run, so this stage is cheap; it also reports the cell-level read-out accuracy on held-out
   images.
2. ``qa``: tower, projector and word embeddings frozen; the decoder learns to answer, with
   several questions packed per image (`collate_scenes`). ``--mimetic`` initialises each
   attention layer's query/key and value/output projections near scaled identities
   (mimetic initialisation, Trockman & Kolter, ICML 2023): a generic prior that attention
   compares like with like and copies what it reads; no attention map is ever supervised.
3. ``tune`` (optional): more decoder steps from ``qa.pt``'s weights with a fresh optimiser,
   typically with another question mix (``--mix count=3 relation=2 ...``: the types to draw
   and their weights; a uniform ``--mix`` draws exactly as the default does).

``--export DIR`` writes the Hugging Face directory after ``qa`` (or, with the ``export``
stage, from ``tune.pt`` where it exists, else ``qa.pt``). Everything is seeded: same
arguments, same model.

The bundled model was made with (`make digitgrid-model` runs the same)::

    T="python -m lightkv_lab.tasks.train"; A="--glyphs colour --out runs/dg"
    $T align $A --steps 300 --lr 2e-3 --warmup 30
    Q="--batch 16 --questions 4 --warmup 100 --mimetic --text-ffn 256"
    $T qa $A $Q --steps 1550 --lr 1e-3
    $T qa $A $Q --steps 2000 --lr 6e-4 --decay    # resumes at step 1550
    $T export --out runs/dg --export lab/lightkv_lab/assets/digitgrid-llava

(about 4 + 33 minutes on 2 CPU cores; the second ``qa`` call resumes from the checkpoint and
decays the learning rate linearly over the remaining steps, which steadied ``count``).

``--task scenes`` trains the default bundled model on Scenes-VQA (`lightkv_lab.tasks.scenes`), whose
tokens carry four labels each (what they show, their kind, their vertical and horizontal
half): ``align`` maps every token to the sum of those words' embeddings (squared error plus
a cross-entropy per label), and ``qa`` trains every decoder layer from a mimetic
initialisation; nothing is frozen or set by hand (``make scenes-model`` has the recipe).

``--task symbolgrid`` trains on SymbolGrid-VQA (`lightkv_lab.tasks.symbolgrid`), where a cell is one
vision token; ``make symbolgrid-model`` has the recipe of the bundled model. Generic
recipes did not learn the single-token lookup within 1,000 ``qa`` steps on 2 CPU cores; the
options written for those attempts stay available: ``--cell-ce`` (a cross-entropy on each
token's cell word in ``align``; without it the cell identity of single tokens stayed
blurred, 43% read-out), ``--translate`` with ``--lookup-heads`` / ``--lookup-qk`` (vision
tokens carry ``M E[word]`` and some heads start as text-to-vision lookups, so a query does
not match itself, as a plain mimetic initialisation makes it do), ``--freeze-lookup``,
``--lookup-from``, ``--slow-layers`` and ``--rope-theta``. What worked is ``--circuit``
(`lightkv_lab.tasks.circuit`): row + column cell embeddings and retrieval heads built at
initialisation from least-squares probes of the projected tokens, then frozen.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightkv.outputs import write_atomic
from lightkv_lab.tasks import circuit
from lightkv_lab.tasks.labels import label_groups, label_loss, translation, vision_words
from lightkv_lab.tasks.model import ModelSpec, alignment_targets, build_model, save
from lightkv_lab.tasks.registry import Task, get_task, task_for
from lightkv_lab.tasks.train_args import build_parser
from lightkv_lab.tasks.train_eval import _projected, evaluate_align, evaluate_qa
from lightkv_lab.tasks.train_init import freeze_lookup, mimetic_init, trainable

__all__ = ["evaluate_qa", "main"]


def _content_ce(
    model,
    feats: torch.Tensor,
    grids: torch.Tensor,
    spec: ModelSpec,
    grid,
    translate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of every token's content read-out (dot products with the content word
    embeddings): a sharper signal for the hard part of the target than the squared error."""
    task = task_for(grid)
    content = vision_words(model, list(task.content_ids()), translate)
    truth, _ = task.token_words(grids, grid.cell // spec.patch)
    logits = feats @ content.T / content.shape[1] ** 0.5
    return F.cross_entropy(logits.flatten(0, 1), truth.flatten())


def _cell_ce(
    model,
    feats: torch.Tensor,
    grids: torch.Tensor,
    spec: ModelSpec,
    grid,
    translate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of every token's cell read-out (dot products with the grid's cell word
    embeddings): where a cell is one token, the squared error alone leaves positions blurred."""
    _, cells = task_for(grid).token_words(grids[:1], grid.cell // spec.patch)  # [N] cell word ids
    names, truth = torch.unique(cells, return_inverse=True)
    emb = vision_words(model, names, translate)
    logits = feats @ emb.T / emb.shape[1] ** 0.5
    return F.cross_entropy(logits.flatten(0, 1), truth.repeat(feats.shape[0]))


@torch.no_grad()
def _vision_sample(model, task: Task, grid, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [n * N, D], symbols [n * N])``: projected vision tokens of ``n`` training
    images (a seeded stream of its own) and what each shows."""
    grids, images = task.image_batch(random.Random("circuit-probe"), "train", n, grid)
    return _projected(model, images).flatten(0, 1), grids.flatten()


def _task(args) -> Task:
    return get_task(getattr(args, "task", "digitgrid"))


def _spec(args):
    task = _task(args)
    if task.name == "digitgrid":
        grid = task.grid_config(glyphs=args.glyphs, jitter=args.jitter)
        patch = ModelSpec.patch
    else:
        grid = task.grid_config()
        patch = grid.cell
    spec = ModelSpec(
        patch=patch,
        rope_theta=getattr(args, "rope_theta", 10000.0),
        text_width=args.text_width,
        text_layers=args.text_layers,
        text_head_dim=getattr(args, "head_dim", None),
        text_ffn=args.text_ffn or 4 * args.text_width,
        vision_width=args.vision_width,
        vision_layers=args.vision_layers,
    )
    return grid, spec


def _last_decoder_checkpoint(out: Path) -> Path:
    """``tune.pt`` where the fine-tuning stage ran, else ``qa.pt``."""
    for name in ("tune.pt", "qa.pt"):
        if (out / name).exists():
            return out / name
    raise SystemExit(f"no qa.pt or tune.pt in {out}: run the qa stage first")


def _mix(args) -> dict:
    """``make_scene`` keywords from ``--mix qtype[=weight] ...`` (empty: the task's default)."""
    if not getattr(args, "mix", None):
        return {}
    qtypes, weights = [], []
    for item in args.mix:
        name, _, weight = item.partition("=")
        if name not in _task(args).data.QTYPES:
            raise SystemExit(
                f"--mix: {name!r} is not a question type of {_task(args).name} "
                f"({', '.join(_task(args).data.QTYPES)})"
            )
        qtypes.append(name)
        weights.append(float(weight) if weight else 1.0)
    # uniform mixes draw exactly as the default does (rng.choice), so older recipes reproduce
    return {
        "qtypes": tuple(qtypes),
        **({} if len(set(weights)) == 1 else {"weights": tuple(weights)}),
    }


def export(args) -> Path:
    """Write the Hugging Face directory from ``--out/tune.pt`` (or ``qa.pt``; sizes from the
    checkpoint)."""
    state = torch.load(_last_decoder_checkpoint(Path(args.out)), weights_only=False)
    saved = argparse.Namespace(**state["args"])
    grid, spec = _spec(saved)
    if getattr(args, "asked", None):
        from dataclasses import replace

        grid = replace(grid, asked=tuple(args.asked))
    model = build_model(spec, grid, seed=saved.seed, task=_task(saved).name)
    model.load_state_dict(state["model"])
    path = save(
        model,
        args.export,
        grid,
        spec,
        task=_task(saved).name,
        extra={"train": state["args"], "step": state["step"], "log": state["log"][-1:]},
    )
    print(f"exported step {state['step']} to {path}")
    return path


def run_stage(args) -> None:
    from tqdm import tqdm

    if _task(args).name == "photos":  # a frozen pretrained tower, cached features
        from lightkv_lab.tasks.photos.train import run

        run(args)
        return
    if args.stage == "export":
        if not args.export:
            raise SystemExit("export needs --export DIR")
        export(args)
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid, spec = _spec(args)
    task = _task(args)
    model = build_model(spec, grid, seed=args.seed, task=task.name)
    if getattr(args, "circuit", False):
        circuit.structure_embeddings(model, task.data, args.seed)
    translate = (
        translation(spec.text_width, args.seed) if getattr(args, "translate", False) else None
    )
    ckpt = out / f"{args.stage}.pt"
    step = 0
    prev = out / "align.pt"
    if args.stage == "tune":
        # fine-tuning starts from the qa stage's final weights, with a fresh optimiser
        start = out / "qa.pt"
        if not start.exists():
            raise SystemExit(
                f"tune starts from {start}, which does not exist: run the qa stage first"
            )
        model.load_state_dict(torch.load(start, weights_only=False)["model"])
    elif args.stage == "qa" and prev.exists():
        aligned = torch.load(prev, weights_only=False)["model"]
        keep = (
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "model.language_model.embed_tokens.",
            "lm_head.",
        )
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in aligned.items() if k.startswith(keep)}, strict=False
        )
        if unexpected or any(k.startswith(keep) for k in missing):
            raise ValueError(
                f"{prev} does not match this model's sizes (missing {missing}, unexpected "
                f"{unexpected}); train qa with the align stage's --vision-* sizes"
            )
        if args.mimetic:
            mimetic_init(
                model,
                seed=args.seed,
                first=args.mimetic_from,
                translate=translate,
                lookup_heads=args.lookup_heads,
                lookup_qk=args.lookup_qk,
                lookup_from=args.lookup_from,
            )
        if getattr(args, "circuit", False):
            heads = circuit.install(
                model,
                task.data,
                grid.grid,
                *_vision_sample(model, task, grid),
                circuit.CircuitSpec(layer=args.circuit_layer),
            )
    params = trainable(model, args.stage)
    if args.stage == "qa" and getattr(args, "circuit", False):
        circuit.freeze(model, args.circuit_layer, heads)
    if args.stage == "qa" and getattr(args, "freeze_lookup", False):
        freeze_lookup(model, max(args.mimetic_from, args.lookup_from), args.lookup_heads)
    groups = [{"params": params, "base_lr": args.lr}]
    slow = getattr(args, "slow_layers", 0)
    if args.stage == "qa" and slow:
        # the first layers learn at a fraction of the rate: what they write into the residual
        # stream moves slowly, so the lookups of the layers after them keep their inputs
        early = {
            id(p)
            for layer in list(model.model.language_model.layers)[:slow]
            for p in layer.parameters()
        }
        groups = [
            {"params": [p for p in params if id(p) not in early], "base_lr": args.lr},
            {"params": [p for p in params if id(p) in early], "base_lr": args.lr * args.slow_lr},
        ]
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    rng = random.Random(f"train:{args.seed}:{args.stage}")
    log = []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        step, log = state["step"], state["log"]
        print(f"resumed {ckpt} at step {step}")

    def schedule(s: int) -> float:
        warm = min(1.0, (s + 1) / args.warmup)
        return warm * (0.1 + 0.9 * max(0.0, 1 - s / args.steps)) if args.decay else warm

    def checkpoint() -> None:
        state = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "log": log,
            "args": vars(args),
        }
        write_atomic(
            ckpt, lambda f: torch.save(state, f)
        )  # a killed run keeps its last whole checkpoint

    n_img = task.data.num_image_tokens(grid, spec.patch)
    mix = _mix(args)
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc=args.stage, mininterval=5, dynamic_ncols=True)
    t0 = time.time()
    running = None
    until = min(args.steps, getattr(args, "until", None) or args.steps)
    while step < until:
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * schedule(step)
        if args.stage == "align":
            grids, images = task.image_batch(rng, "train", args.batch, grid)
            feats = _projected(model, images)
            if label_groups(task) is not None:
                loss = label_loss(model, feats, grids, label_groups(task), translate)
            else:
                target = alignment_targets(
                    model, grids, spec.patch, grid.cell, task=task, translate=translate
                )
                loss = F.mse_loss(feats, target) + _content_ce(
                    model, feats, grids, spec, grid, translate
                )
            if args.cell_ce:
                loss = loss + _cell_ce(model, feats, grids, spec, grid, translate)
        else:
            scenes = [
                task.data.make_scene(rng, "train", args.questions, grid, **mix)
                for _ in range(args.batch)
            ]
            batch = task.data.collate_scenes(scenes, n_img)
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        running = value if running is None else 0.98 * running + 0.02 * value
        bar.update(1)
        bar.set_postfix(loss=f"{running:.4f}")
        if step % args.eval_every == 0 or step in (args.steps, until):
            if args.stage == "align":
                ev = evaluate_align(model, spec, grid, translate=translate)
            else:
                ev = evaluate_qa(model, grid, n_per_type=args.eval_n)
            entry = {"step": step, "loss": running, "minutes": (time.time() - t0) / 60, **ev}
            log.append(entry)
            bar.write(json.dumps(entry))
        if step % args.ckpt_every == 0 or step in (args.steps, until):
            checkpoint()
    bar.close()
    if args.export and args.stage in ("qa", "tune"):
        save(
            model,
            args.export,
            grid,
            spec,
            task=task.name,
            extra={"train": vars(args), "step": step, "log": log[-1:]},
        )
        print(f"exported to {args.export}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_stage(args)


if __name__ == "__main__":
    main()
