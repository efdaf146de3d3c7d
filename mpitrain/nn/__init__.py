"""Modules, layers, activation checkpointing and models (no MPI here)."""

from mpitrain.nn.checkpoint import checkpoint, checkpointed
from mpitrain.nn.layers import (AvgPool2d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, GELU, GlobalAvgPool,
                                 LayerNorm, Linear, MaxPool2d, ReLU)
from mpitrain.nn.models import GPT, ConvNet, GPTConfig, LeNet, ResNet
from mpitrain.nn.module import Module, ModuleList, Sequential
from mpitrain.tensor import Parameter

__all__ = ["AvgPool2d", "BatchNorm2d", "Conv2d", "ConvNet", "Dropout", "Embedding", "Flatten", "GELU", "GPT",
           "GPTConfig", "GlobalAvgPool", "LayerNorm", "LeNet", "Linear", "MaxPool2d", "Module", "ModuleList",
           "Parameter", "ReLU", "ResNet", "Sequential", "checkpoint", "checkpointed"]
