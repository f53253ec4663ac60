"""slowmo_lab: the lab around hvd_slowmo training runs (arXiv 1910.00643's tables and ablations).

It sits beside the library, not inside it, and uses only hvd_slowmo's public API
(``hvd_slowmo.BASES``, ``hvd_slowmo.comm.Communicator``, the optimizer's documented attributes):
the library never imports it. Its modules:

- :mod:`.metrics`: TensorBoard metrics written during training (rank 0 writes).
- :mod:`.report`: the paper's tables and a figure from those metrics
  (``python -m slowmo_lab.report runs/`` or ``hvd-slowmo-report``).
- :mod:`.sweep`: ablation sweeps over tau, alpha/beta, lr, buffers and worker counts
  (``python -m slowmo_lab.sweep SCRIPT ...`` or ``hvd-slowmo-sweep``).
- :mod:`.time_to_accuracy`: seconds to a target accuracy, from the same metrics.
- :mod:`.netns`: emulated hosts (network namespaces, ``tc`` rate and delay) for network mode.
"""
