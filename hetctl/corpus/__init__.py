"""Token corpora: Megatron's indexed dataset format, ``hetctl data prepare``, and the trainer's samples.

Torch-free (numpy only), so the controller can check a dataset before any rank
starts and ``hetctl data prepare`` runs on a machine without torch.

- :mod:`hetctl.corpus.indexed`: read and write ``PREFIX.bin`` + ``PREFIX.idx``.
- :mod:`hetctl.corpus.tokenize`: a local Hugging Face tokenizer, or UTF-8 bytes.
- :mod:`hetctl.corpus.sources`: documents from ``.txt``, ``.jsonl`` and ``.parquet`` files.
- :mod:`hetctl.corpus.prepare`: the two together, written atomically.
- :mod:`hetctl.corpus.samples`: training windows by (seed, step, row), blends, held-out splits.
"""
