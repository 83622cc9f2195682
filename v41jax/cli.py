"""The `v41jax` command (`python -m v41jax` does the same).

v41jax bytes                      # the seed's tables: 890 B vs 3514 B, indexer cost at 1M
v41jax bytes --context 64K        # the indexer table at another context length
v41jax bytes --preset tiny --per-layer
v41jax bytes --json               # the same numbers, structured
v41jax params                     # parameter counts: toy presets and the real V4.1-Flash stack
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from v41jax import accounting
from v41jax.config import PRESETS, preset


def _context(text: str) -> int:
    try:
        return accounting.parse_context(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _bytes(args: argparse.Namespace) -> int:
    context, per_layer = args.context, args.per_layer
    if args.json and args.preset is None:
        text = json.dumps(accounting.seed_summary(context), indent=2)
    elif args.json:
        summary = accounting.config_summary(preset(args.preset), context)
        text = json.dumps({"context": context, "presets": {args.preset: summary}}, indent=2)
    elif args.preset is None:
        text = accounting.render_seed_report(context, per_layer=per_layer)
    else:
        text = accounting.render_config(args.preset, preset(args.preset), context, per_layer)
    print(text)
    return 0


def _params(args: argparse.Namespace) -> int:
    from v41jax.model import parameter_counts  # imports flax; `bytes` stays light

    names = args.preset or ["tiny", "small", "v41_flash"]
    counts = {name: parameter_counts(preset(name)) for name in names}
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    keys = sorted({k for c in counts.values() for k in c}, key=_param_row_order)
    width = max(len(k) for k in keys)
    print("parameters (counted abstractly with nnx.eval_shape; nothing is allocated)")
    print("  " + " " * width + "".join(f"{n:>16}" for n in names))
    for key in keys:
        print(f"  {key:<{width}}" + "".join(f"{counts[n].get(key, 0):>16,}" for n in names))
    print("  v41_flash's FFN is a dense placeholder: the real model's MoE is out of scope.")
    return 0


def _param_row_order(key: str) -> tuple[int, str]:
    order = {"attention": 0, "ffn": 2, "embed_and_head": 3, "total": 4}
    return (order.get(key, 1), key)


def _add_bytes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        type=_context,
        default=accounting.DEFAULT_CONTEXT,
        metavar="N",
        help="tokens of context for the indexer cost and the KV size per sequence: "
        "65536, 64K, 1M (K = 1024; default 1M)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="print one preset's tables instead of the seed's V4.1-Flash vs V4-Flash comparison",
    )
    parser.add_argument("--per-layer", action="store_true", help="add a row for every layer")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="v41jax",
        description="DeepSeek-V4.1's hierarchical sparse indexer and FP4 KV cache, in JAX. "
        "Without a command, runs `bytes` with its defaults.",
    )
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    bytes_parser = commands.add_parser(
        "bytes",
        aliases=["report"],
        help="global KV bytes per token and indexer multiply-adds, computed from the config "
        "(the default command)",
        description="Global KV bytes per token (main KV + indexer K), the window KV, and the "
        "indexer multiply-adds per decoded token with and without the candidate pool, all "
        "computed from the presets and the packed row layouts (DESIGN §5).",
    )
    _add_bytes_arguments(bytes_parser)
    bytes_parser.set_defaults(run=_bytes)
    params_parser = commands.add_parser(
        "params",
        help="parameter counts of the attention stack, FFN and embeddings, per preset",
        description="Counts the parameters of the model built from each preset without "
        "allocating it (nnx.eval_shape), split by layer role.",
    )
    params_parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        help="a preset to count (repeatable; default: tiny, small, v41_flash)",
    )
    params_parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    params_parser.set_defaults(run=_params)
    # `train`, which becomes the default command, is added here.
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default: `sys.argv[1:]`); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["bytes"])
    try:
        return args.run(args)
    except BrokenPipeError:  # `v41jax bytes | head`: stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
