"""Training through the window: the lookahead stage, the plan executor, the train pipeline."""

from torchrec_lookahead.pipeline.train import LookaheadTrainPipeline

__all__ = ["LookaheadTrainPipeline"]
