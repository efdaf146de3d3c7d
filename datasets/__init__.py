"""Dataset recipes: read standard source files, verify them, write mpitrain shards.

Installed as the package ``mpitrain_datasets`` (see setup.cfg). One module per source
format; :data:`RECIPES` maps the names ``mpitrain data build NAME`` accepts to them, and
:mod:`mpitrain_datasets.download` fetches and verifies the canonical files for
``mpitrain data download NAME`` before running the same recipes.
Every recipe writes through :class:`mpitrain.data.writer.DatasetWriter`, so a build is
atomic and refuses an output directory that holds another dataset.
"""

from mpitrain_datasets.recipes import RECIPES, Recipe, build

__all__ = ["RECIPES", "Recipe", "build"]
