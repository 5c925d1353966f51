"""Metrics: the Recorder (log lines, progress bar, summary.json) and one file per logger it writes through:
metrics.jsonl (always), TensorBoard, W&B and MLflow (metrics.loggers), each imported only when named; and
`distrib plot` (plot.py, matplotlib imported only there)."""

from distrib.metrics.recorder import Recorder, require_loggers, write_json_atomic

__all__ = ["Recorder", "require_loggers", "write_json_atomic"]
