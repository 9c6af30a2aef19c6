"""Experiment tracking from the driver (`--track mlflow|wandb`): a run's config, metrics rows,
summary, figure and status sent to MLflow or Weights & Biases by the process that already holds
every row. Workers never import a tracking client. Both clients are an optional extra
(`pip install 'raytrain-lm[track]'`), imported only when a tracker is asked for.

    tracking.py     Tracking: one run's tracking runs, fed in order from one background thread
    mlflow_run.py   the MLflow client's side (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...)
    wandb_run.py    the W&B client's side (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, ...)
"""

from raytrain_lm.track.tracking import EXTRA, TRACKERS, Tracking, check_trackers, flat_params
