"""Held-out evaluation: the model's lm loss on sequences it never trains on (data.eval_path).

Every train.eval_interval steps and after the last step, every rank runs the model forward (no gradients, the
step's compute dtype, in micro-batches of train.micro_batch_size) over its slice of the first train.eval_batches
global batches of the held-out dataset (TokenLoader positions 0.. of data.eval_path: the same sequences every time,
so evaluations compare), and the per-micro-batch lm losses are averaged over all ranks. Rank 0 appends
{step, eval_lm_loss, eval_sequences, eval_s, time} to eval.jsonl, feeds the tracking backends and logs a line.

Nothing of the training state moves: no gradients, no optimizer, no expert-bias update (the balancer takes the
loads the step hands it), the training loader's position untouched; a run with evaluation trains bitwise like one
without. Its seconds are left out of the next step's tokens/s. The heartbeat is refreshed after every micro-batch,
so a long evaluation is not taken for a hang. A step that received a stop signal skips it (the stop's checkpoint
comes first). Pipeline parallelism is refused at config time (conf/checks.py).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import torch

from moe_launch.conf.schema import RootConfig
from moe_launch.errors import DataError
from moe_launch.trainer.data import TokenLoader
from moe_launch.trainer.heartbeat import HeartbeatWriter

if TYPE_CHECKING:  # metrics.py imports this module's line format
    from moe_launch.trainer.metrics import MetricsSink


def eval_due(done: int, interval: int, steps: int) -> bool:
    """Whether the held-out loss is measured after step `done` (1-based). Pure."""
    return interval > 0 and (done % interval == 0 or done == steps)


class HeldOut:
    def __init__(self, cfg: RootConfig, data_rank: int, data_size: int, device: torch.device):
        t, d = cfg.train, cfg.data
        self.loader = TokenLoader(d.eval_path, d.format, t.seq_len, t.global_batch_size, data_rank, data_size,
                                  t.seed, vocab_size=cfg.model.vocab_size)
        self.batches, self.micro, self.device = t.eval_batches, t.micro_batch_size, device
        self.sequences = t.eval_batches * t.global_batch_size
        if self.loader.n_instances < self.sequences:  # more would wrap around and count sequences twice
            raise DataError(f"data.eval_path={d.eval_path}: {self.loader.n_instances} sequences, fewer than the "
                            f"{self.sequences} of train.eval_batches x train.global_batch_size; lower "
                            "train.eval_batches or hold out more data")

    def lm_loss(self, model: torch.nn.Module, dtype: torch.dtype, all_reduce_: Callable[[torch.Tensor], object],
                scope: Callable[[], ContextManager], beat: Callable[[], None]) -> float:
        """Mean lm loss over the held-out batches, the same on every rank. `scope`: the experts' weight scope of a
        step (FP8 quantizes each weight once per evaluation where the step does); `beat`: refreshes the heartbeat."""
        sums_2 = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of micro-batch losses, count)
        with torch.no_grad(), scope():
            for b in range(self.batches):
                for mb_BL in self.loader.get(b).to(self.device).split(self.micro):
                    with torch.autocast(self.device.type, dtype=dtype, enabled=dtype != torch.float32):
                        _, parts = model.compute_loss(mb_BL[:, :-1], mb_BL[:, 1:])
                    sums_2 += torch.stack([parts.lm_loss.double(), sums_2.new_ones(())])
                    beat()
        all_reduce_(sums_2)
        return float(sums_2[0] / sums_2[1])

    def evaluate(self, done: int, model: torch.nn.Module, dtype: torch.dtype,
                 all_reduce_: Callable[[torch.Tensor], object], scope: Callable[[], ContextManager],
                 heartbeat: HeartbeatWriter, sink: Optional[MetricsSink]) -> float:
        """One evaluation after step `done`; rank 0 (the one with a sink) records it. Returns its seconds."""
        t0 = time.perf_counter()
        loss = self.lm_loss(model, dtype, all_reduce_, scope, lambda: heartbeat.beat(done))
        seconds = time.perf_counter() - t0
        if sink is not None:
            sink.log_eval({"step": done, "eval_lm_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)),
                           "eval_sequences": self.sequences, "eval_s": seconds, "time": time.time()})
        return seconds


def format_eval_line(record: dict) -> str:
    """The log line of one evaluation. Pure."""
    return (f"eval after step {record['step']}: lm loss {record['eval_lm_loss']:.4f} (ppl {record['eval_ppl']:.2f}) "
            f"over {record['eval_sequences']} held-out sequences, {record['eval_s']:.1f} s")
