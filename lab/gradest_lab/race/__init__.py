"""``gradest race``: which estimator buys the most reward for the same compute?

* :mod:`~gradest_lab.race.plain_race`: the compute-matched race at one learning rate
  (:func:`~gradest_lab.race.plain_race.race`, :class:`~gradest_lab.race.plain_race.RaceTask`);
* :mod:`~gradest_lab.race.tuned_race`: every estimator at its own learning rate, tuned on
  seeds disjoint from the reported ones; its runs are stored one file each
  (:mod:`~gradest_lab.race.shards`) and its page is :mod:`~gradest_lab.race.tuned_page`;
* :mod:`~gradest_lab.race.file_schemas`: what its files must hold when read back (a
  shard's row and curve, a run's saved state, the settings ``run.json`` records);
* :mod:`~gradest_lab.race.verdicts`: the reference (``exact``) and a decision row's
  verdicts (ahead / level / behind), which the pages quote and the plots draw;
* :mod:`~gradest_lab.race.bootstrap`: paired bootstrap intervals over seeds;
* :mod:`~gradest_lab.race.task_options`: a task's settings from ``--task-option``;
* :mod:`~gradest_lab.race.quoting`: race numbers in markdown pages, generated from the
  committed reports;
* :mod:`~gradest_lab.race.command`: the command line.
"""
