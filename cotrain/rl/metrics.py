"""Where step metrics go: a JSONL file (always; the source for plots and resume checks),
TensorBoard (default), and optionally Weights & Biases and MLflow.

Metric names are ``group/name`` (``reward/mean``, ``kl/train_infer``, ``spec/acceptance_length``,
``time/rollout``...), the same in every sink. What the less obvious ones measure:

- ``kl/ref``: k3 estimate of KL(policy || reference) on the step's response tokens, measured in
  the update's forward pass, i.e. on the weights *before* this step's optimizer step: at step k it
  is KL(pi_{k-1} || pi_ref) on rollouts pi_{k-1} sampled. Step 1 is exactly 0 (pi_0 is the
  reference); what step k's update did shows at step k+1. Unclamped (grpo.kl_clamp caps only the
  penalty).
- ``kl/train_infer``: k3 estimate of KL(engine || trainer) on the same weights, float64, >= 0;
  ``kl/train_infer_max_abs_diff``: the largest per-token log-prob difference.
- ``reward/format_error``: fraction of responses without a well-formed answer
  (cotrain.tasks.rewards.grade), scored reward.format_error.
- ``eval/accuracy``: exact-match accuracy on the held-out prompts (never training prompts).

A crash can cut the last line of metrics.jsonl short; reading it (resume, plots) skips such a line
with a warning naming file and line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path


def _optional(module: str, key: str):
    try:
        return __import__(module)
    except ImportError:
        raise RuntimeError(f"{key}: true needs the '{module}' package, which is not installed "
                           f"(pip install {module}, or set {key}=false)") from None


class MetricsLogger:
    def __init__(self, cfg, resume_step: int = 0):
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "metrics.jsonl"
        if self.jsonl.exists():  # keep the history of the steps before the resume point only
            kept = [json.dumps(r) for r in _parse_lines(self.jsonl) if r["step"] <= resume_step]
            self.jsonl.write_text("".join(k + "\n" for k in kept))
        self.tb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg.logging.tensorboard_dir, purge_step=resume_step + 1 if resume_step else None)
        self.wandb = None
        if cfg.logging.wandb.enabled:
            wandb = _optional("wandb", "logging.wandb.enabled")

            w = cfg.logging.wandb
            self.wandb = wandb.init(project=w.project, entity=w.entity, mode=w.mode, name=cfg.run.name,
                                    config=cfg.to_dict(), dir=str(self.out), resume="allow")
        self.mlflow = None
        if cfg.logging.mlflow.enabled:
            mlflow = _optional("mlflow", "logging.mlflow.enabled")

            mlflow.set_tracking_uri(cfg.logging.mlflow.tracking_uri)
            mlflow.set_experiment(cfg.logging.mlflow.experiment)
            self.mlflow = mlflow
            mlflow.start_run(run_name=cfg.run.name)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace("/", ".") : v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()


def _parse_lines(path: Path) -> list[dict]:
    """The records of a metrics.jsonl. A line that does not parse as a record with a ``step`` - the
    partial last line of a run killed mid-write - is skipped with a warning naming file and line."""
    rows = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as e:
            warnings.warn(f"{path}:{lineno}: skipping an unreadable metrics line (a write cut short?): "
                          f"{type(e).__name__}: {e}", stacklevel=3)
            continue
        rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (is it a cotrain run directory?)")
    return _parse_lines(path)
