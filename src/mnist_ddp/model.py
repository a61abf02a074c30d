"""The tutorial's two-layer CNN, unchanged, so its checkpoints are interchangeable."""

import torch
from torch import nn


class ConvNet(nn.Module):
    """Conv(1→16,5) BN ReLU MaxPool → Conv(16→32,5) BN ReLU MaxPool → Linear(7·7·32→10).

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
        out = self.layer2(self.layer1(x))
        return self.fc(out.flatten(1))
