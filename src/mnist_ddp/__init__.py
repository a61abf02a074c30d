"""mnist-ddp: the classic MNIST CNN, trained with DistributedDataParallel, done right.

Reading order for DDP: launch.py (start the processes; per rank: join, train, leave) →
identity.py (who am I) → distributed.py (the process group) → batches.py (sharding) →
train.py (DDP wrap, the loop, rank-0 outputs) → evaluation.py (all-reduced accuracy).
"""

__version__ = "0.1.0"
