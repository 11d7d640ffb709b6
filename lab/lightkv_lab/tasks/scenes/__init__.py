"""Scenes-VQA: a synthetic VQA task with the token statistics of natural images.

See `lightkv_lab.tasks.scenes.data` for the images, questions, vocabulary and batching. The model,
trainer and evaluation are DigitGrid's (`lightkv_lab.tasks.digitgrid`), parametrised by task.
"""
