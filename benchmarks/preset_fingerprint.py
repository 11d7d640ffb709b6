"""Fingerprint every preset: survivors (provenance), report and logits, to compare two trees.

Every shipped preset, fitted to a 50% (tiny models) or 40% (bundled models) kept fraction by
`lightkv_lab.bench.budgets.knob_pipeline` (the library's knob; ``method_pipeline`` before
it), runs greedy generation (3 tokens) on the tiny
random LLaVA, LLaVA-NeXT and Qwen2.5-VL models of `lightkv.testing` and on the three bundled
models (a held-out image and question each); a preset a model cannot take records its error.
Used to check that a refactoring changes no behaviour (issue 37: the laboratory's move,
recorded at the commit before it with ``PYTHONPATH=<export of that commit>``):

```
python benchmarks/preset_fingerprint.py record before.pt     # on the old tree
python benchmarks/preset_fingerprint.py record after.pt      # on the new one
python benchmarks/preset_fingerprint.py compare before.pt after.pt   # exit 1 if any differs
```

Everything is compared exactly (``torch.equal``); about 10 minutes on 2 CPU cores.
"""

import sys

import torch

torch.set_num_threads(1)


def lab():
    try:
        from lightkv_lab.bench import budgets
        from lightkv_lab.tasks import evaluate
        from lightkv_lab.tasks.digitgrid.images import to_pil
        from lightkv_lab.tasks.model import BUNDLED_MODELS, read_grid_config
    except ImportError:
        from lightkv.bench import budgets
        from lightkv.tasks import evaluate
        from lightkv.tasks.digitgrid.images import to_pil
        from lightkv.tasks.model import BUNDLED_MODELS, read_grid_config
    # trees before the library's kept-fraction knob (issue 52) had the laboratory's own copy
    knob_pipeline = getattr(budgets, "knob_pipeline", None) or budgets.method_pipeline
    return knob_pipeline, evaluate, to_pil, BUNDLED_MODELS, read_grid_config


def run(pipe, model, batch, options):
    import lightkv

    gen = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        if pipe is None:
            out = model.generate(**batch, **gen)
            return {"seq": out.sequences, "logits": torch.stack(out.logits)}
        with lightkv.apply(pipe, model, **options) as session:
            out = model.generate(**batch, **gen)
            rep = session.report()
    rows = batch["input_ids"].shape[0]
    return {
        "seq": out.sequences,
        "logits": torch.stack(out.logits),
        "sources": [rep.sources(r) for r in range(rows)],
        "report": str(rep),
    }


def record(path):
    from lightkv_lab.tiny import TINY_MODELS

    import lightkv
    from lightkv.presets import PRESETS

    print("lightkv from", lightkv.__file__, file=sys.stderr)
    knob_pipeline, evaluate, to_pil, BUNDLED, read_grid = lab()
    res = {}
    for fam_name in ("llava", "llava_next", "qwen2_5_vl"):
        fam = TINY_MODELS[fam_name]
        model = fam.build()
        batch = fam.collate(fam.examples(model))
        layers = model.config.get_text_config().num_hidden_layers
        res[(fam_name, None)] = run(None, model, batch, fam.adapter_options)
        for name in sorted(PRESETS):
            try:
                pipe = knob_pipeline(name, layers, 0.5)[0]
                res[(fam_name, name)] = run(pipe, model, batch, fam.adapter_options)
            except Exception as e:  # noqa: BLE001
                res[(fam_name, name)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    from lightkv import generate as g

    for bundled in sorted(BUNDLED):
        path_ = str(BUNDLED[bundled])
        loaded = g.load_model(path_, dtype="float32", device="cpu")
        eps = evaluate.heldout_episodes(2, seed=0, grid=read_grid(BUNDLED[bundled]))
        inputs = g.build_inputs(loaded, to_pil(eps[0].image), " ".join(eps[0].question))
        model = loaded.model if hasattr(loaded, "model") else loaded[0]
        layers = model.config.get_text_config().num_hidden_layers
        res[(bundled, None)] = run(None, model, dict(inputs), {})
        for name in sorted(PRESETS):
            try:
                pipe = knob_pipeline(name, layers, 0.4)[0]
                res[(bundled, name)] = run(pipe, model, dict(inputs), {})
            except Exception as e:  # noqa: BLE001
                res[(bundled, name)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    torch.save(res, path)
    ok = sum("error" not in v for v in res.values())
    print(f"{len(res)} cases, {ok} ran, {len(res) - ok} refused", file=sys.stderr)


def compare(a, b):
    A, B = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    assert A.keys() == B.keys(), set(A) ^ set(B)
    bad = []
    for k in A:
        x, y = A[k], B[k]
        if x.keys() != y.keys():
            bad.append((k, "keys"))
            continue
        for f in x:
            same = torch.equal(x[f], y[f]) if isinstance(x[f], torch.Tensor) else x[f] == y[f]
            if not same:
                bad.append((k, f))
    ran = sum("error" not in v for v in A.values())
    print(f"{len(A)} cases ({ran} ran, {len(A) - ran} refused alike): {len(bad)} differ {bad[:10]}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
