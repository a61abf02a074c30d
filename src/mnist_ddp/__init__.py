"""mnist-ddp: the classic MNIST CNN, trained with DistributedDataParallel, done right.

Reading order for DDP: distributed.py (who am I, process group) → batches.py
(sharding) → train.py (DDP wrap, the loop, rank-0 outputs) → evaluation.py
(all-reduced accuracy) → launch.py (spawn, torchrun, SLURM).
"""

__version__ = "0.1.0"
