"""The training loop with its extensions: `ExtendedTrainer` is `trainer.Trainer` plus what a run takes only when asked
for or where it applies (`trainer_for` picks): the run's M micro-batch slots dealt over any world (`--accumulate`,
`--bitwise`, a world other than the run's, docs/design/slots.md), `--profile`, `--resume`, `--recover`
(recovery/), and the CUDA graph step (cudagraph/). Each method adds to the Trainer's method of the same name."""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .common.config import TrainConfig
from .core import ddp, reduction
from .core.batches import ShardedBatches, Share, Step, StepBatches
from .core.bnstats import PartStats
from .core.distributed import Dist
from .core.evaluation import EvalResult, evaluate
from .core.steps import slot_step
from .cudagraph import graphstep
from .data import datasets
from .outputs import saving, summary
from .outputs.report import Reporter
from .outputs.timeline import StepProfiler
from .recovery import recovery
from .recovery.recovery import Grow, Recovery
from .trainer import Stepped, Trainer


def trainer_for(cfg: TrainConfig, d: Dist, data: datasets.Dataset, rank0: Reporter,
                recovery: Recovery | None = None) -> Trainer:
    """The textbook `Trainer` where the run needs nothing more, else `ExtendedTrainer`. Every flag named here is off
    by default (TrainConfig: no --recover, --bitwise, --profile, --resume; --accumulate 1; --graph-step auto), so a
    default run on a CPU trains with `Trainer` (tests/test_structure.py); on a GPU the graph step may apply."""
    extended = (recovery is not None or cfg.bitwise or bool(cfg.profile) or cfg.accumulate > 1 or cfg.resume
                or cfg.graph_step == "on" or d.device.type == "cuda")
    return ExtendedTrainer(cfg, d, data, rank0, recovery) if extended else Trainer(cfg, d, data, rank0)


class ExtendedTrainer(Trainer):
    """A `Trainer` whose world may train the run's M micro-batch slots in any share, may change (`--recover`), and
    whose step may be the slot step or the CUDA graph's."""

    stats: PartStats  # BatchNorm's statistics, a set per part of the step

    def __init__(self, cfg: TrainConfig, d: Dist, data: datasets.Dataset, rank0: Reporter,
                 recovery: Recovery | None = None) -> None:
        self.recovery = recovery
        self.graph: graphstep.GraphStep | None = None  # the CUDA graph step: `run` decides
        self.graph_loss = torch.zeros((), device=d.device)
        self.profiler = StepProfiler(cfg.profile, d, rank0, Path(cfg.out) / "profile")  # --profile (timeline.py)
        super().__init__(cfg, d, data, rank0)
        if recovery:  # --recover keeps a copy of the state at each step's start (snapshot.py)
            recovery.follow(self.t)

    def _deal(self, share: Share | None = None, saved_stats: torch.Tensor | None = None) -> None:
        """Deal the run's M slots over this world (`share`; at the start, M = world × --accumulate): this rank's batches
        (and test shard), its BatchNorm sets (`saved_stats`: a checkpoint's, a recovery's) and the gradients'
        reduction. Where each rank trains one whole slot (W = M, no --bitwise or --profile) the batches and the step
        are the textbook's; else `StepBatches` and the slot step."""
        cfg, r, d, train = self.cfg, self.cfg.recipe, self.d, self.data.train
        share = share or Share(slots=d.world_size * cfg.accumulate, world=d.world_size, whole=cfg.bitwise)
        ddp.check_sync_bn(cfg.sync_bn, share)
        super()._deal()
        self.share = share
        self.textbook = share.slots == share.world and not cfg.bitwise and not cfg.profile
        if not self.textbook:
            self.train_batches = StepBatches(train.images, train.labels, r.batch_size, share, rank=d.rank,
                                             seed=cfg.seed, **self.batch_form)
        self.stats = PartStats(self.t.model, share, d.rank, saved_stats)
        self.reduction = reduction.for_run(cfg.bitwise, self.t.model, share, d.rank)
        if self.recovery and isinstance(self.reduction, reduction.SlotReduction):  # --recover keeps every part's set
            self.reduction.carry_sets(self.stats.held, sum(b.numel() for b in self.stats.live), saved_stats)

    def run(self) -> EvalResult:
        """`Trainer.run`, after a `--resume`'s checkpoint, and with a world that may change inside an epoch: a rank
        lost or replacements joining (--recover) re-form it, wrap the model again and go on."""
        if self.cfg.resume:
            self._resume()
        self._begin()
        if self._reached(self.t.progress.best_accuracy):  # an epoch before the resume reached the target
            self.target_outcome = "already"
            return evaluate(self.t.model, self.test_batches, self.d, self.amp)
        self.profiler.watch(self.reduction)
        if self.recovery and self.recovery.joining:  # a replacement of a lost rank: the run's state from rank 0
            self.recovery.handover(self)
        self.graph = graphstep.choose(self.cfg, self.d, self.t, self.train_batches, self.textbook, self.rank0.say)
        self.net = self._wrap()
        if self.graph:  # None: some rank could not capture it, and every rank trains the eager step
            self.graph = self.graph.prepare(self.net, self.rank0.say)
        if self.graph:  # the graph takes each epoch's order once, then each step's index
            assert isinstance(self.train_batches, ShardedBatches)  # the graph step is the textbook's
            self.train_batches = graphstep.GraphBatches(self.train_batches, self.graph)
        result = None
        while (epoch := self.t.progress.epoch) < self.cfg.recipe.epochs:
            try:
                result = self._epoch(epoch)
            except (Grow, RuntimeError) as e:  # --recover: a rank was lost, or replacements join (recovery.py)
                change = recovery.world_change(self.recovery, e)
            else:
                if self._reached(result.accuracy):
                    self.target_outcome = "reached"
                    return result
                continue
            # the old group's DDP wrapper goes before the group (out here: the error's frames held it)
            self.net = self.t.model
            assert self.recovery is not None  # world_change raised the error again without it
            self.recovery.change(self, change)
            self.net = self._wrap()
        return self._end(result)  # None: a finished run resumed

    def _wrap(self) -> nn.Module:
        """`Trainer._wrap`, and: DDP's all-reduce replaced by `reduction` (--bitwise, --profile), no `static_graph`
        where a rank trains several micro-batches a step under no_sync, the graph step's stream and gradients."""
        hook = self.reduction if self.cfg.bitwise or self.cfg.profile else None  # else: DDP's own all-reduce
        g = self.graph  # the graph step's DDP: on its capture stream, the gradients in its flat buffer
        return ddp.wrap(self.t.model, self.d, sync_bn=self.cfg.sync_bn, compile=self.cfg.compile,
                        accumulating=self.share.parts > self.share.world, hook=hook, stream=g.stream if g else None,
                        keep_grads=g is not None)

    def _epoch(self, epoch: int) -> EvalResult:
        """`Trainer._epoch`; under --recover a small all-reduce after its saves (`Recovery.saved`)."""
        result = super()._epoch(epoch)
        if self.recovery:  # a rank lost while rank 0 saved is lost inside the loop (recovery.py)
            self.recovery.saved(self)
        return result

    def _before_step(self, epoch: int) -> None:
        """Under --recover replacements may join here, and the state this step starts from is kept."""
        if self.recovery:
            self.recovery.step_begins(self)
        super()._before_step(epoch)

    def _step(self, batch: Any) -> Stepped:
        """One optimizer step, of the kind this run trains, chosen here alone (each takes the batches its kind deals):
        - the textbook step (`Trainer._step`): each rank one micro-batch of a global batch, DDP's all-reduce mean;
        - the slot step: --bitwise, --accumulate, --profile, or a world re-formed smaller than the run's slots
          (`slot_step`: the micro-batches in slot order, the reduction in `reduction.py`);
        - the CUDA graph: the textbook step captured once and replayed (graphstep.py)."""
        if self.graph:
            return self._graph_step(batch)
        return super()._step(batch) if self.textbook else self._slot_step(batch)

    def _slot_step(self, batch: Step) -> Stepped:
        loss_sum = slot_step(self.net, self.t.opt, batch, self.stats, self.reduction, amp=self.amp,
                             label_smoothing=self.cfg.recipe.label_smoothing, scaler=self.t.scaler,
                             phase=self.profiler.phase)
        here = sum(len(mb.y) for mb in batch.micro_batches)
        return Stepped(loss_sum.div(max(here, 1)), here, batch.samples)  # a rank of --bitwise may train no sample

    def _graph_step(self, batch: int) -> Stepped:
        """`batch`: the step's index in its epoch (graphstep.py)."""
        assert self.graph is not None
        here = self.graph.size(batch)  # a loss made on the device (tests/collectives.py)
        return Stepped(self.graph_loss.copy_(self.graph.step(batch)), here, here * self.d.world_size)

    def _after_step(self) -> None:
        """`Trainer._after_step`, and --profile's step ended."""
        super()._after_step()
        self.profiler.step(self.step_in_epoch, self.train_batches.steps_per_epoch)

    def _train_epoch(self, epoch: int, began: float) -> float:
        """`Trainer._train_epoch`; --recover's tests may lose a rank after it (before the evaluation)."""
        seconds = super()._train_epoch(epoch, began)
        self._lose_here("evaluation")
        return seconds

    def _add_up(self) -> torch.Tensor:
        """Under --recover the state this fold starts from is kept first; its tests may lose a rank once the ranks'
        sums are in, before rank 0 writes the steps they hold."""
        if self.recovery:
            self.recovery.fold_begins(self)
        totals = super()._add_up()
        self._lose_here("folded")
        return totals

    def _save(self, best: EvalResult | None = None) -> None:
        """`Trainer._save`; --recover's tests may lose a rank before it."""
        self._lose_here("save")
        super()._save(best)

    def _resume(self) -> None:
        """Continue from `<out>/checkpoint.pt`, at any world size: the run's M slots are the checkpoint's."""
        resumed = saving.resume(Path(self.cfg.out) / "checkpoint.pt", self.t, self.cfg, self.d,
                               len(self.data.train.labels), self.rank0.say)
        if resumed is None:  # none yet: the run starts from scratch (saving.resume said so)
            return
        self.rank0.keep_epochs_before(self.t.progress.epoch)  # a line of the epoch in progress was never saved
        self._deal(resumed.share, resumed.batchnorm_parts)
        if line := summary.resume_line(resumed.world_was, resumed.share, self.cfg):
            self.rank0.say(line)

    def _lose_here(self, point: str) -> None:
        """Tests of --recover only: a loss planned at this point of the loop (lossplan.py)."""
        if self.recovery:
            self.recovery.plan.reached(point, self.steps_done)
