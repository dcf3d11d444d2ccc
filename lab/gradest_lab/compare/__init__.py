"""``gradest compare``: the command, its embedded problems, jagg's sweeps and the report folder.

* :mod:`~gradest_lab.compare.command`: the command line (``gradest compare``);
* :mod:`~gradest_lab.compare.problems`: the embedded problems it runs without a download
  (``mlp``, ``dit``, and those registered under ``gradest.problems``);
* :mod:`~gradest_lab.compare.sweeps`: jagg's error against its group span, gate threshold
  and debiasing draws;
* :mod:`~gradest_lab.compare.report_files`: ``report.md``, ``report.json`` and the plots,
  written at once.
"""
