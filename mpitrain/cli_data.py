"""``mpitrain data``: build, download, verify and describe shard datasets; the parsers and
what each action runs (registered by :mod:`mpitrain.cli`; the recipes: ``datasets/``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mpitrain.cli_common import _failure, _usage
from mpitrain.output import folder_option, unwritable, whole_folder_option


def add_parser(commands) -> None:
    from mpitrain_datasets import RECIPES

    data = commands.add_parser("data", help="download, build, check and describe shard datasets",
                               description="HDF5 shard datasets (format: datasets/README.md).")
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    recipes = "\n".join(f"  {name:22} --src: {r.src}" for name, r in RECIPES.items())
    p = actions.add_parser("build", help="turn standard dataset files into shards",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Read a dataset in its standard format, verify it, and write a "
                                       "shard directory atomically.\n\nrecipes:\n" + recipes)
    p.add_argument("name", choices=sorted(RECIPES), metavar="NAME", help="the recipe (listed above)")
    p.add_argument("--src", help="the source files (see the recipe)")
    p.add_argument("--out", required=True, type=whole_folder_option, help="the dataset directory to write")
    p.add_argument("--shard-mb", type=float, default=16, help="megabytes per shard file (default 16)")
    p.add_argument("--chunk-kb", type=float, default=1024, help="HDF5 chunk size in KiB (default 1024)")
    p.add_argument("--compression", choices=("gzip", "lzf"), default=None,
                   help="compress chunks (default none: see 'mpitrain bench io' for the cost)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="text: the held-out share at the end of the text (default 0.1)")
    p.add_argument("--vocab-of", metavar="DATASET",
                   help="text: ids in the vocabulary of DATASET (a shard directory, or an embedded name such as "
                        "shakespeare), so that a model trained there fine-tunes here; a character outside it is "
                        "refused")
    p.add_argument("--unverified-source", action="store_true",
                   help="IDX: accept files whose SHA-256 is not the published one")
    p.set_defaults(run=_data_build)
    _download_parser(actions)
    p = actions.add_parser("verify", help="re-hash every shard against the manifest",
                           description="Check the structure of every shard and re-hash its content.")
    p.add_argument("path", help="a dataset directory")
    p.set_defaults(run=_data_verify)
    p = actions.add_parser("info", help="describe a dataset directory",
                           description="Print a dataset's splits, shards, sizes and metadata.")
    p.add_argument("path", help="a dataset directory")
    p.set_defaults(run=_data_info)


def _download_parser(actions) -> None:
    from mpitrain_datasets.download import DOWNLOADS, MIRROR_ENV

    p = actions.add_parser(
        "download", help="download a dataset's canonical files, verify them, build shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download the canonical files of NAME, check their published hashes, keep them in a "
                    "cache, and build\nshards with the recipe 'mpitrain data build' uses. An interrupted "
                    "download continues where it\nstopped; nothing unverified is kept (details: "
                    "datasets/download.py).\n\ndatasets:\n"
                    + "\n".join(f"  {n:16} {s.about}" for n, s in DOWNLOADS.items())
                    + "\n\nOffline, get the files by hand and build them with 'mpitrain data build' (a "
                      "failed download prints\nthe command). Fashion-MNIST also comes with Debian: apt-get "
                      "install dataset-fashion-mnist, then\nmpitrain data build fashion-mnist-debian --out "
                      "runs/data/fashion-mnist.")
    p.add_argument("name", choices=list(DOWNLOADS), metavar="NAME", help="the dataset (listed above)")
    p.add_argument("--out", type=whole_folder_option,
                   help="the dataset directory to write (default runs/data/NAME, where the configs in jobs/ look)")
    p.add_argument("--cache", type=folder_option,
                   help="where downloaded files are kept, as CACHE/NAME/FILE (default downloads/ in $MPITRAIN_DATA, "
                        "else in $XDG_CACHE_HOME/mpitrain or ~/.cache/mpitrain)")
    p.add_argument("--mirror", metavar="URL",
                   help=f"fetch from URL/NAME/FILE only, not the canonical hosts (default ${MIRROR_ENV}, "
                        "if set); e.g. a cache directory served over HTTP")
    p.set_defaults(run=_data_download)


def _data_build(args) -> None:
    from mpitrain_datasets import RECIPES

    recipe = RECIPES[args.name]
    if recipe.needs_src and not args.src:
        raise _usage(f"data build {args.name}: --src is required ({recipe.src})")
    options = {"shard_mb": args.shard_mb, "chunk_kb": args.chunk_kb, "compression": args.compression}
    if args.val_fraction is not None:
        if not recipe.text:
            raise _usage(f"data build {args.name}: --val-fraction applies to text recipes only")
        options["val_fraction"] = args.val_fraction
    if args.vocab_of:
        if args.name != "text":
            raise _usage(f"data build {args.name}: --vocab-of applies to the text recipe only")
        options["vocab"] = _vocab_of(args.vocab_of)
    if args.unverified_source:
        if not recipe.idx:
            raise _usage(f"data build {args.name}: --unverified-source applies to IDX recipes only")
        options["unverified_source"] = True
    _built(args.out, lambda: recipe.build(args.src, args.out, **options))


def _vocab_of(name: str) -> str:
    """The vocabulary of the text dataset ``name`` (a shard directory, or an embedded one)."""
    from mpitrain.data import open_dataset
    from mpitrain_datasets import embedded

    path = Path(name) if Path(name).is_dir() else None
    if path is None and name in embedded.DEFAULTS:
        embedded.ensure(name, print)
        path = embedded.location(name)
    if path is None:
        raise _usage(f"--vocab-of {name}: no such dataset directory or embedded dataset")
    data = open_dataset(path)
    try:
        if data.kind != "text":
            raise _usage(f"--vocab-of {name}: holds {data.kind} data, not text")
        return data.vocab
    finally:
        data.close()


def _data_download(args) -> None:
    from mpitrain_datasets import download

    out = args.out or download.default_out(args.name)
    for path, folder in ((out, False), (args.cache or download.default_cache(), True)):  # before the download
        if (why := unwritable(path, folder=folder, whole=not folder)) is not None:
            raise _failure(why)
    src = download.fetch(args.name, cache=args.cache, mirror=args.mirror, out=out)
    _built(out, lambda: download.build(args.name, src, out))


def _built(out, build) -> None:
    """Run ``build`` (a recipe's, returning its DatasetWriter) and print what is in ``out`` now."""
    tick = time.perf_counter()
    writer = build()
    splits = ", ".join(f"{s} {v['count']:,} in {len(v['shards'])} shard(s)"
                       for s, v in writer.manifest["splits"].items())
    state = "already up to date" if writer.up_to_date else f"written in {time.perf_counter() - tick:.1f} s"
    print(f"{out}: {writer.name} ({writer.kind}): {splits}; {state}")


def _data_verify(args) -> int:
    from mpitrain.data import open_dataset

    data = open_dataset(args.path)
    if problems := data.verify():
        print(*(f"mpitrain: damaged: {p}" for p in problems), sep="\n", file=sys.stderr)
        return 1
    print(f"{args.path}: {data.name}: {sum(len(s.shards) for s in data.splits.values())} shards, "
          "structure and content SHA-256 match the manifest")
    return 0


def _data_info(args) -> None:
    from mpitrain.data import open_dataset

    data = open_dataset(args.path)
    m = data.manifest
    print(f"{data.path}: {data.name} ({data.kind}), format version {m['version']}, "
          f"compression {m['compression'] or 'none'}, written by {m.get('written_by', '?')} on {m.get('created', '?')}")
    for split in data.splits.values():
        size = sum(s.bytes for s in split.shards)
        print(f"  {split.name}: {split.count:,} x {list(split.sample_shape)} {split.x_dtype.name}, "
              f"{len(split.shards)} shard(s), {size / 1e6:.1f} MB, {split.chunk_rows} rows per chunk")
    if data.kind == "image":
        print(f"  classes: {', '.join(data.classes)}")
        print(f"  mean {list(data.mean)}, std {list(data.std)}")
    else:
        print(f"  vocabulary of {len(data.vocab)}: {data.vocab!r}")
