"""Training through the window: the lookahead stage, the plan executor, the train pipeline."""

from torchrec_lookahead.pipeline.batch_check import BatchCheck, CheckedBatch
from torchrec_lookahead.pipeline.train import LookaheadTrainPipeline

__all__ = ["BatchCheck", "CheckedBatch", "LookaheadTrainPipeline"]
