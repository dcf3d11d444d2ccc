"""Bridges from gradest to the rest of the PyTorch ecosystem.

Each submodule is imported on its own, so that gradest never imports an optional
dependency it does not need:

* :mod:`gradest.integrations.distributed`: helpers around DDP / FSDP2 data parallelism
  (``rank_generator``, ``check_same_estimator``, ``process_group_from_env``).
* :mod:`gradest.integrations.peft`: LoRA adapters through ``peft`` (``add_lora``).
* :mod:`gradest.integrations.diffusers`: ``diffusers`` flow-matching and DDIM / DDPM
  schedulers, transformers and UNets (``flow_from_scheduler``, ``DiffusersVelocity``; the
  samplers' own ``RectifiedFlow.from_scheduler`` and ``DDIM.from_scheduler`` use it).
"""
