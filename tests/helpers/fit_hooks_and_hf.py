"""Two things fit() takes, in one script so that the world-size tests share their process starts:
- a fine-tune with frozen BatchNorm layers, with and without the FreezeBatchNorm callback, every hook call logged per
  rank (OUT/with, OUT/without, OUT/hooks_rankR.jsonl);
- a Hugging Face datasets.Dataset from Dataset.from_dict(...).with_format("torch") and its train_test_split, given to
  fit unchanged (OUT/hf).

    python tests/helpers/fit_hooks_and_hf.py OUT            (or under torchrun --nproc-per-node 2)"""

import os
import sys
from pathlib import Path

from distrib import fit
from tests.helpers import hf_data
from tests.helpers.callbacks import FreezeBatchNorm, HookLog, fine_tune_data, fine_tune_net

LOG_EVERY = 4
OVERRIDES = {"train.epochs": 3, "train.global_batch_size": 32, "train.lr": 0.05, "train.warmup_steps": 2,
             "train.log_every": LOG_EVERY, "train.eval_every_epochs": 1, "data.eval_batch_size": 24,
             "run.progress": False, "dist.device": "cpu", "checkpoint.every_steps": 0}
HF_OVERRIDES = {**OVERRIDES, "train.epochs": 0, "train.max_steps": 12, "train.eval_every_epochs": 0}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    train, test = fine_tune_data()
    log = HookLog(out / f"hooks_rank{os.environ.get('RANK', '0')}.jsonl", LOG_EVERY)
    fit(fine_tune_net, train, test, overrides={**OVERRIDES, "run.dir": str(out / "with")},
        callbacks=[FreezeBatchNorm(), log])
    fit(fine_tune_net, train, test, overrides={**OVERRIDES, "run.dir": str(out / "without")})
    fit(hf_data.classifier, *hf_data.splits("torch"), overrides={**HF_OVERRIDES, "run.dir": str(out / "hf")})
