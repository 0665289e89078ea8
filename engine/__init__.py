"""The engine: runs an autoplan Plan under torchrun on PyTorch's distributed stack.

Entry point and launch commands: :mod:`engine.run`. The common core: ``mesh`` (process
group, DeviceMesh), ``validate`` (pre-collective checks), ``data``, ``train`` (the loop),
``metrics`` / ``memory`` (measurements), ``checkpoint`` (DCP), ``config`` (RunConfig),
``launch`` (``autoplan run``). The runtimes, behind one small protocol chosen from the plan
(:mod:`engine.runtime`; which one is data, :func:`autoplan.capability.runtime_for`):

* uniform — Megatron-style, for the built-in GPT and the Hugging Face causal LMs with a stage
  adapter: ``parallelize`` (the fixed order), ``model`` / ``hf_stage`` / ``hf_arch`` (stage
  chunks), ``tensor_parallel``, ``data_parallel`` (the ZeRO mapping), ``pipeline``,
  ``expert_parallel`` (expert and context parallelism);
* per-op — search plans on stage submeshes of any shape: ``staged``, ``placements``,
  ``zero``, ``transfer``;
* generic — any other model from the plan's placements alone: ``generic``,
  ``generic_train``; also behind :func:`autoplan.parallelize` in a user's own script.
"""
