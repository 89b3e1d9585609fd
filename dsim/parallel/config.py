"""The `parallel:` section: how the ranks share the model (dsim.parallel.layout reads it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..section import key, need


def _pipeline_schedules():
    from .pipeline import SCHEDULES
    return SCHEDULES


@dataclass
class ParallelConfig:
    """How the ranks share the model (MindSpore's device matrix, model parallel innermost)."""
    data_parallel: Optional[int] = key(None, "data-parallel replicas; null: the world size / (model_parallel x "
                                             "pipeline_stage)", ">= 1 or null")
    model_parallel: int = key(4, "ranks that split each layer (Megatron-style column / row slices)", ">= 1")
    optimizer_shard: int = key(1, "ranks of a data-parallel group that each update 1/k of a weight and its "
                                  "optimizer state (MindSpore's optimizer_weight_shard_size)", "1, a divisor of dp, or dp")
    vocab_emb_dp: bool = key(True, "transformer: word embeddings whole on every rank (false: vocabulary split over mp)")
    pipeline_stage: int = key(1, "pipeline stages, each a block of dp x mp consecutive ranks (MindSpore's "
                                 "pipeline_stages)", ">= 1, dividing the world")
    micro_batch_num: int = key(1, "micro-batches each rank's part of the global batch is cut into "
                                  "(MindSpore's PipelineCell(net, micro_batch_num))", ">= pipeline_stage")
    pipeline_schedule: str = key("1f1b", "order of micro-batch forwards and backwards: 1f1b (MindSpore's) or gpipe "
                                         "(all forwards, then all backwards)", _pipeline_schedules)

    def validate(self) -> None:
        for name in ("data_parallel", "model_parallel", "optimizer_shard", "pipeline_stage", "micro_batch_num"):
            value = getattr(self, name)
            if value is not None:
                need(isinstance(value, int) and value >= 1, f"parallel.{name}", "an integer >= 1", value)
        schedules = _pipeline_schedules()
        need(self.pipeline_schedule in schedules, "parallel.pipeline_schedule", f"one of {', '.join(schedules)}",
             self.pipeline_schedule)
        need(self.micro_batch_num >= self.pipeline_stage, "parallel.micro_batch_num",
             f">= parallel.pipeline_stage={self.pipeline_stage} (MindSpore requires micro_batch_num >= pipeline "
             "stages)", self.micro_batch_num)
