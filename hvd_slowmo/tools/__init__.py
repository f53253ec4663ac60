"""Tools around training runs (arXiv 1910.00643's tables and ablations): TensorBoard metrics
written during training (:mod:`.metrics`), the paper's tables from them (:mod:`.report`,
``python -m hvd_slowmo.tools.report`` or ``hvd-slowmo-report``) and ablation sweeps
(:mod:`.sweep`, ``python -m hvd_slowmo.tools.sweep`` or ``hvd-slowmo-sweep``)."""
