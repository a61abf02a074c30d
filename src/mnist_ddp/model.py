"""The tutorial's two-layer CNN, its layers unchanged, so its checkpoints are interchangeable."""

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval


class ConvNet(nn.Module):
    """Conv(1→16,5) BN ReLU MaxPool → Conv(16→32,5) BN ReLU MaxPool → Linear(7·7·32→10), each ReLU applied after
    its max-pool: the same numbers, forward and backward, as the tutorial's order (docs/speed.md#the-cpus-pace).

    The attribute names `layer1`, `layer2`, `fc` are part of the contract: they give
    the `state_dict` keys `layer1.0.weight … fc.bias` that the tutorial's model uses.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, bn, relu, pool in (self.layer1, self.layer2):
            x = relu(pool(bn(conv(x))))  # after the max-pool, the ReLU touches a quarter of the values
        return self.fc(x.flatten(1))


def for_inference(model: ConvNet) -> nn.Module:
    """`model`, in eval mode, as a cheaper module computing the same function up to rounding: each BatchNorm (in eval
    mode an affine map) folded into a copy of the convolution before it, and each ReLU after its max-pool (the two
    commute), where it touches a quarter of the values. `model` is left as it is."""
    layers: list[nn.Module] = []
    for conv, bn, relu, pool in (model.layer1, model.layer2):
        assert isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d)
        layers += [fuse_conv_bn_eval(conv, bn), pool, relu]  # which refuses a model in training mode
    return nn.Sequential(*layers, nn.Flatten(), model.fc)
