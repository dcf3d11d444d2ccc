"""gradest's lab: what races, tunes, prices a training step at scale and stores runs.

A distribution beside the library (``pip install ./lab``), built on gradest's public API
only (``gradest``, ``gradest.plugin``, ``gradest.harness`` and the other documented
namespaces). It adds three commands to the ``gradest`` command line and one estimator:

* :mod:`gradest_lab.compare`: ``gradest compare``, the main job: the library's
  :func:`gradest.harness.compare` on an embedded problem, with jagg's sweeps, written to a
  report folder with plots;
* :mod:`gradest_lab.race`: ``gradest race``: estimators fine-tuning one task at equal
  compute, over paired seeds, plain or with each estimator's learning rate tuned on
  seeds disjoint from the reported ones; the numbers the docs quote are generated from
  the committed race folders (:mod:`gradest_lab.race.quoting`);
* :mod:`gradest_lab.cost`: ``gradest cost``: FLOPs, retained activations and peak
  memory of one training step per estimator on a diffusers model's shapes, traced on the
  meta device (no GPU, no weights);
* :mod:`gradest_lab.storage`: the files runs keep: written atomically, one run per
  folder (``run.json`` and a lock), TOML config files;
* :mod:`gradest_lab.auto`: the ``auto`` estimator, a measuring policy: it measures its
  candidates on the user's own minibatches and uses the best one.
"""
