"""mnist-ddp: the classic MNIST CNN, trained with DistributedDataParallel, done right.

From Python or a notebook: `mnist_ddp.train(...)`, `evaluate(...)`, `predict(...)`, the command line's twins
(api.py); their results are plain data (results.py).

Reading order for DDP: launch.py (start the processes; per rank: join, train, leave) →
identity.py (who am I) → distributed.py (the process group) → batches.py (sharding) →
trainer.py (DDP wrap, the loop, rank-0 outputs) → evaluation.py (all-reduced accuracy).
"""

import warnings

from .api import evaluate, predict, train
from .common.errors import UserError
from .common.results import Evaluation, Prediction, Run

__version__ = "0.1.0"
__all__ = ["Evaluation", "Prediction", "Run", "UserError", "evaluate", "predict", "train"]

# torch warns as it is imported when numpy is missing; nothing here needs numpy (a base install, `pip install
# mnist-ddp`, has none), so in every process of a job those two lines would only be noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
