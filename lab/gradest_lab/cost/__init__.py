"""``gradest cost``: what one training step of each estimator costs, traced without a GPU.

* :mod:`~gradest_lab.cost.command`: the command and :func:`~gradest_lab.cost.command.predict_costs`;
* :mod:`~gradest_lab.cost.training_cost`: one training step traced on the meta device
  (FLOPs, retained activations, peak memory);
* :mod:`~gradest_lab.cost.call_replay` and :mod:`~gradest_lab.cost.repeated_blocks`: trace
  a model call once and replay its cost; measure a model with long runs of identical
  blocks from short runs;
* :mod:`~gradest_lab.cost.pixel_cost`: the VAE decode and the reward model of a pixel reward;
* :mod:`~gradest_lab.cost.fused_attention`: attention as a GPU runs it, on the meta device;
* :mod:`~gradest_lab.cost.diffusers_presets`, :mod:`~gradest_lab.cost.decoder_presets`,
  :mod:`~gradest_lab.cost.reward_presets`: the shipped models' shapes;
* :mod:`~gradest_lab.cost.recipe_defaults`: what the reward recipes run by default
  (``--recipe-defaults``);
* :mod:`~gradest_lab.cost.doc_figures`: the pages' cost figures, generated from the
  committed ``--json`` files and checked against them.
"""
