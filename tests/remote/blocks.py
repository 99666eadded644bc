"""Models with one block that can run on a remote tier, and the block the server builds."""

from __future__ import annotations

import time

import torch
from torch import nn

from shoal.remote import RemoteModule

WIDTH = 32


class Block(nn.Module):
    """The block that moves: two linear layers, a residual and a layer norm (buffers: none)."""

    def __init__(self, width: int = WIDTH, delay_s: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.norm(x + self.fc2(torch.tanh(self.fc1(x))))


def block(width: int = WIDTH, delay_s: float = 0.0) -> Block:
    """What `shoal remote serve --module tests.remote.blocks:block` serves."""
    return Block(width, delay_s)


class Net(nn.Module):
    """64 digit pixels -> WIDTH -> Block -> 10 classes; the block local or remote."""

    def __init__(self, remote: bool = False, width: int = WIDTH):
        super().__init__()
        self.embed = nn.Linear(64, width)
        middle = Block(width)
        self.block = RemoteModule(middle) if remote else middle
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(torch.relu(self.embed(x))))


def model(remote: bool = False, width: int = WIDTH) -> Net:
    """The run config's model builder."""
    torch.manual_seed(0)
    return Net(remote, width)


class Swapped(Block):
    """Another module with the Block's parameters: relu where the Block has tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


def swapped(width: int = WIDTH) -> Swapped:
    """What a server that replaced the Block's serves (`--module tests.remote.blocks:swapped`)."""
    return Swapped(width)
