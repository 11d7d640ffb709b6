"""SymbolGrid-VQA: a synthetic VQA task whose answers need the content of single vision tokens.

See `lightkv_lab.tasks.symbolgrid.data` for the images, questions, vocabulary and batching. The
model, trainer and evaluation are DigitGrid's (`lightkv_lab.tasks.digitgrid`), parametrised by task.
"""
