"""The reference pipeline trainer (torch, optional extra): ``python -m hetctl.train`` runs one rank.

Modules: ``model`` (decoder-only transformer in checkpoint units), ``data``
(deterministic synthetic batches), ``topology`` (the rank's place, from the
plan), ``pipeline`` (1F1B step, point-to-point and all-reduce), ``ckpt``
(layer-granular checkpoints), ``saver`` (saves off the training step), ``main`` (the rank's entry point),
``tied`` (a tied table across stages), ``hfconvert``/``hfweights``/``hfio`` (Hugging Face names, checks and
weights in), ``export`` (a checkpoint out as a Hugging Face folder).
Importing this package does not import torch.
"""
