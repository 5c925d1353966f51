"""Training and using a trained model: the Trainer and its TrainState (the step and the loop), the worker's set-up and
end around them (building, resuming, opening, finish), losses, exact evaluation, EMA, early stopping, throughput, the
dry batch before step 1, eval/predict on a trained run, and generate on a text run."""

from distrib.training.evaluation import evaluate
from distrib.training.state import TrainState, new_state
from distrib.training.trainer import Trainer

__all__ = ["TrainState", "Trainer", "evaluate", "new_state"]
