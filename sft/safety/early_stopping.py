"""`--early_stopping_patience N`: transformers' EarlyStoppingCallback ends the run when the evaluation's metric
(--metric_for_best_model, the eval loss unless given: sft/options/resolve.py) has not improved by more than
--early_stopping_threshold for N evaluations in a row. The Trainer then stops in silence and the run summary reads
like any other; this subclass says why it stopped, at which step, and where the best evaluation was. The final save
and its verification follow as usual; with --load_best_model_at_end the Trainer first loads the best checkpoint,
which our rotation never deletes (sft/safety/checkpoints.py keeps state.best_model_checkpoint)."""

from __future__ import annotations

from transformers import EarlyStoppingCallback, TrainerControl, TrainerState, TrainingArguments


class EarlyStopping(EarlyStoppingCallback):
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics, **kwargs):
        stopped_before = control.should_training_stop
        super().on_evaluate(args, state, control, metrics, **kwargs)
        if control.should_training_stop and not stopped_before and state.is_world_process_zero:
            metric = args.metric_for_best_model
            metric = metric if metric.startswith("eval_") else f"eval_{metric}"
            best = f"{state.best_metric:.4g}" if state.best_metric is not None else "none"
            where = f", checkpoint {state.best_model_checkpoint}" if state.best_model_checkpoint else ""
            print(f"Stopped early at step {state.global_step}: {metric} has not improved for "
                  f"{self.early_stopping_patience} evaluations (best {best}{where}).", flush=True)


def early_stopping(args) -> list[EarlyStopping]:
    """The callback where --early_stopping_patience asks for it."""
    if not args.early_stopping_patience:
        return []
    return [EarlyStopping(args.early_stopping_patience, args.early_stopping_threshold)]
