"""Per-batch metrics averaged over the Trainer's logging window, for trainers whose ``compute_loss``
measures more than the loss (DPO's and KTO's implicit rewards, log-probs, …) and whose evaluation
is that loss."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import Trainer

    TrainerBase = Trainer
else:
    TrainerBase = object  # a mixin: the Trainer comes after it in the subclass's bases

# Metrics summed over the logging window and the processes; every other metric is averaged.
SUMMED_METRICS = {"num_tokens"}


class MetricWindow(TrainerBase):
    """Mixin for a ``transformers.Trainer`` subclass (listed before ``Trainer``): ``record_metrics``
    in ``compute_loss``; each logged line then carries the window's metrics, ``eval_``-prefixed after
    an evaluation. The windows open when the trainer is built; :meth:`checkpoint_state` /
    :meth:`load_checkpoint_state` carry the open windows through a checkpoint, so a resumed run logs
    what an uninterrupted one does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_window()

    def checkpoint_state(self) -> dict:
        """What a resumed run needs beyond the ``Trainer``'s checkpoint (trainers/runtime/checkpoints.py): the
        open windows. A trainer with more state extends it."""
        return {"window_metrics": self.window_state()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.load_window_state(state["window_metrics"])

    def init_window(self) -> None:
        self.window_metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record_metrics(self, metrics: dict[str, torch.Tensor], mode: str) -> None:
        """One batch's metrics, averaged (``num_tokens``: summed) over the processes. They may come
        from several devices (a counter built on the CPU, a teacher's on its own device): each is
        gathered from the process's device."""
        names = list(metrics)
        device = self.accelerator.device
        stacked = torch.stack([metrics[n].detach().float().to(device) for n in names]).unsqueeze(0)
        gathered = self.accelerator.gather(stacked)  # (processes, metrics)
        for name, total, mean in zip(names, gathered.sum(0).tolist(), gathered.mean(0).tolist()):
            self.window_metrics[mode][name].append(total if name in SUMMED_METRICS else mean)

    def window_state(self) -> dict:
        return {mode: dict(window) for mode, window in self.window_metrics.items()}

    def load_window_state(self, state: dict) -> None:
        self.window_metrics = {mode: defaultdict(list, window) for mode, window in state.items()}

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation is the loss and its metrics (recorded in the ``eval`` window); no predictions."""
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        assert isinstance(loss, torch.Tensor)  # without return_outputs, the loss alone
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the window's metrics to the Trainer's logs: ``num_tokens`` summed, the others averaged."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self.window_metrics[mode].items():
            logs[prefix + name] = sum(values) if name in SUMMED_METRICS else sum(values) / len(values)
        self.window_metrics[mode].clear()
        super().log(logs, start_time)
