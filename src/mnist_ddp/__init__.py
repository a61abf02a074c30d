"""mnist-ddp: the classic MNIST CNN, trained with DistributedDataParallel, done right.

From Python or a notebook: `mnist_ddp.train(...)`, `evaluate(...)`, `predict(...)`, the command line's twins
(api.py); their results are plain data (results.py).

Reading order for DDP: launch.py (start the processes) → worker.py (per rank: join, train, leave) →
identity.py (who am I) → distributed.py (the process group) → batches.py (sharding) →
trainer.py (the textbook loop: DDP wrap, steps, rank-0 outputs) → evaluation.py (all-reduced accuracy).
"""

import os
import warnings

# torch's C++ side logs its warnings, each with a C++ stack, straight to stderr: a peer that closed its socket
# as the job stops is a wall of frames under our one line. Errors still show; TORCH_CPP_LOG_LEVEL=WARNING (or
# INFO) brings the rest back. Read once, as torch is imported: so here, before anything imports it.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from .api import evaluate, predict, train
from .common.errors import UserError
from .common.results import Evaluation, Prediction, Run

__version__ = "0.1.0"
__all__ = ["Evaluation", "Prediction", "Run", "UserError", "evaluate", "predict", "train"]

# torch warns as it is imported when numpy is missing; nothing here needs numpy (a base install, `pip install
# mnist-ddp`, has none), so in every process of a job those two lines would only be noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
