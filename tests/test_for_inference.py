"""Evaluation runs the model's inference form (model.for_inference): BatchNorm folded into the convolutions, ReLU
after the max-pool. It must compute the model's own function, up to rounding, in either memory format, and leave the
model as it was; the evaluation's numbers must be the ones the model's own forward gives."""

import copy

import pytest
import torch
import torch.nn.functional as F

from mnist_ddp.core.batches import ShardedBatches
from mnist_ddp.core.distributed import Dist
from mnist_ddp.core.evaluation import evaluate
from mnist_ddp.model import ConvNet, for_inference
from mnist_ddp.tutorial import TutorialConvNet

CPU = torch.device("cpu")


def _trained_looking(seed: int, channels_last: bool) -> ConvNet:
    """A ConvNet whose BatchNorm layers hold statistics and affine weights far from their defaults (the fold would
    have nothing to fold at the defaults)."""
    torch.manual_seed(seed)
    model = ConvNet()
    with torch.no_grad():
        for bn in (model.layer1[1], model.layer2[1]):
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.uniform_(-1.0, 1.0)
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.2, 3.0)
    return model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
def test_the_inference_form_computes_the_models_function(channels_last: bool) -> None:
    model = _trained_looking(0, channels_last).eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(64, 1, 28, 28)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    net = for_inference(model)
    with torch.inference_mode():
        ours, theirs = net(x), model(x)
        unfolded = model.fc(F.max_pool2d(F.relu(model.layer2[0](F.max_pool2d(F.relu(model.layer1[0](x)), 2))), 2)
                            .flatten(1))  # the control: the same layers without their BatchNorm
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5), (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(1), theirs.argmax(1))
    assert (unfolded - theirs).abs().max() > 100 * 1e-5  # a fold that lost BatchNorm would be caught above
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # a copy: the model untouched
    with pytest.raises(AssertionError):  # a model in training mode is refused, not switched to eval behind its back
        for_inference(model.train())
    assert all(m.training for m in model.modules())


def test_the_evaluation_gives_the_models_own_numbers() -> None:
    """evaluate() through the inference form against the model's own forward, by hand: the same count of correct
    answers, the same confusion matrix, the loss equal up to rounding; and the model left in training mode."""
    model = _trained_looking(1, channels_last=False).train()
    g = torch.Generator().manual_seed(2)
    images, labels = torch.randint(0, 256, (500, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (500,),
                                                                                                          generator=g)
    batches = ShardedBatches(images, labels, 128, rank=0, world=1, device=CPU, shuffle=False, each_sample_once=True)
    result = evaluate(model, batches, Dist(0, 0, 1, 1, CPU))
    assert model.training
    with torch.inference_mode():
        logits = torch.cat([model.eval()(x) for x, _ in batches])
    confusion = torch.bincount(labels * 10 + logits.argmax(1), minlength=100).reshape(10, 10)
    assert torch.equal(result.confusion, confusion) and result.count == 500
    assert result.loss == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-5)


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels_last"])
def test_training_with_relu_after_the_pool_is_the_tutorials_order_bit_for_bit(channels_last: bool) -> None:
    """ConvNet's forward applies each ReLU after its max-pool; the tutorial's applies it before. Three AdamW steps of
    each from the same weights give the same losses and weights, bit for bit (max and ReLU commute, and their
    gradients reach the same inputs); the control, the same steps from inputs one rounding apart, must differ."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 1, 28, 28, generator=g).contiguous(memory_format=layout), torch.randint(0, 10, (64,),
                                                                                                   generator=g)

    def trained(model_class: type[ConvNet], images: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = model_class().to(memory_format=layout)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(model(images), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, model.state_dict()

    ours, theirs = trained(ConvNet, x), trained(TutorialConvNet, x)
    nudged = trained(TutorialConvNet, x.nextafter(torch.full_like(x, torch.inf)))
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))
    assert all(torch.equal(v, theirs[1][k]) for k, v in ours[1].items())
    assert not all(torch.equal(v, nudged[1][k]) for k, v in ours[1].items())
