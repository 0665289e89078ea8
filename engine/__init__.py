"""The engine: runs an autoplan Plan under torchrun on PyTorch's distributed stack.

Entry point and launch commands: :mod:`engine.run`; the order in which parallelisms are
applied: :mod:`engine.parallelize`; the ZeRO mapping: :mod:`engine.data_parallel`.
One concern per module: ``mesh`` (process group, DeviceMesh), ``validate`` (pre-collective
checks), ``model`` (stage chunks, initialisation; Hugging Face models through ``hf_stage``
and the per-architecture stage adapters of ``hf_arch``), ``tensor_parallel``, ``data_parallel``,
``pipeline``, ``data``, ``train`` (the loop), ``metrics`` / ``memory`` (measurements),
``checkpoint`` (DCP), ``config`` (RunConfig), ``launch`` (``autoplan run``).
"""
