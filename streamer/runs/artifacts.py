"""The run directory `runs/<run>/`: its files, writers, readers and summary, from one import.

    runs/<run>/config.json           the run's configuration (any JSON object)
    runs/<run>/trajectories/part-00001.parquet ...   one row per trajectory (live run)
    runs/<run>/trajectories.parquet  the same rows in one file (after `RunWriter.close`, which also fills each
                                     row's learner_step/learner_version from the learner's events)
                                     (readers add `seq`, the task's stream position, from its id)
    runs/<run>/learner/part-*.parquet | learner.parquet   one row per LearnerEvent, metrics as columns
    runs/<run>/metrics/part-*.parquet | metrics.parquet   MetricPoint rows, labels as columns
    runs/<run>/drift.jsonl           DriftEvent JSON lines
    runs/<run>/samples.jsonl         the first and latest answers per (family, concept, phase) as text (`samples`)
    runs/<run>/summary.json          `summarize(run_dir)` (written at close; present = finished)
    runs/<run>/checkpoints/          the learner's checkpoints

Each part has its module: `layout` (paths, atomic writes), `writers` (rows, parts, compaction),
`readers` (tolerant reads of a live or finished run), `trained` (which step trained each
trajectory), `summary` (summary.json). The metrics themselves are `streamer.runs.adaptation`'s.
"""

from __future__ import annotations

from streamer.runs.layout import (
                                  TABLES,
                                  ArtifactError,
                                  checkpoints_dir,
                                  compacted_through,
                                  finite,
                                  table_files,
                                  table_paths,
                                  write_atomic,
                                  write_json,
)
from streamer.runs.readers import (
                                  list_runs,
                                  read_config,
                                  read_drift,
                                  read_json,
                                  read_learner,
                                  read_metrics,
                                  read_part,
                                  read_summary,
                                  read_table,
                                  read_trajectories,
                                  standing,
                                  task_seq,
)
from streamer.runs.summary import eval_points, summarize
from streamer.runs.trained import effective_events, fill_learner_columns, trained_by
from streamer.runs.writers import MP_FIELDS, RunWriter, TableWriter, learner_row, metric_row, trajectory_row

__all__ = [
    "MP_FIELDS", "TABLES", "ArtifactError", "RunWriter", "TableWriter", "checkpoints_dir", "compacted_through",
    "effective_events", "eval_points", "fill_learner_columns", "finite", "learner_row", "list_runs", "metric_row",
    "read_config", "read_drift", "read_json", "read_learner", "read_metrics", "read_part", "read_summary",
    "read_table", "read_trajectories", "standing", "summarize", "table_files", "table_paths", "task_seq",
    "trained_by", "trajectory_row", "write_atomic", "write_json",
]
