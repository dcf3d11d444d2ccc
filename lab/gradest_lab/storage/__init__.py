"""The files runs keep, and the rules every writer of them follows.

* :mod:`~gradest_lab.storage.files`: checked before the work, replaced atomically, never
  half-written, never through a link or onto a device;
* :mod:`~gradest_lab.storage.run_folder`: a run folder belongs to one run (its
  ``run.json`` and its lock, :mod:`~gradest_lab.storage.process_lock`);
* :mod:`~gradest_lab.storage.config_file`: settings from a TOML file as a command's defaults;
* :mod:`~gradest_lab.storage.file_schema`: what every reader of a file read back shares;
* :mod:`~gradest_lab.storage.json_text`: the one JSON parser of what is read back (its
  nesting bounded, never a ``RecursionError``).
"""
