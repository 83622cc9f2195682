"""The `v41jax` command (`python -m v41jax` does the same).

v41jax bytes                      # the seed's tables: 890 B vs 3514 B, indexer cost at 1M
v41jax bytes --context 64K        # the indexer table at another context length
v41jax bytes --preset tiny --per-layer
v41jax bytes --json               # the same numbers, structured
v41jax params                     # parameter counts: toy presets and the real V4.1-Flash stack
v41jax mesh                       # data × context meshes for 8, 64, 512 H200s at 1M tokens
v41jax mesh --devices 16,128 --json
v41jax train                      # the main job: train tiny() with pools + FP4 QAT (<= 5 min)
v41jax train --task mqar --steps 2000 --kv-format mxfp4 --block-score mean --out runs/x
v41jax train --seeds 0-4          # the main job on seeds 0..4, in one program on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from v41jax import accounting, tables
from v41jax.nn.config import PRESETS, preset
from v41jax.ops import formats
from v41jax.ops.pool import BLOCK_REDUCERS


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
        text = tables.render_seed_report(context, per_layer=per_layer)
    else:
        text = tables.render_config(args.preset, preset(args.preset), context, per_layer)
    if args.devices is not None:
        if args.devices < 1:
            print(
                f"v41jax bytes: error: --devices: expected N >= 1, got {args.devices}",
                file=sys.stderr,
            )
            return 2
        name = args.preset or "v41_flash"
        traffic = tables.render_sharded_traffic(name, preset(name), context, args.devices)
        text = text + "\n\n" + traffic
    print(text)
    return 0


def _params(args: argparse.Namespace) -> int:
    from v41jax.nn.model import parameter_counts  # imports flax; `bytes` stays light

    names = args.preset or ["tiny", "small", "v41_flash"]
    counts = {name: parameter_counts(preset(name)) for name in names}
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    print(tables.render_parameter_counts(counts))
    return 0


def _mesh(args: argparse.Namespace) -> int:
    from v41jax.nn.model import parameter_counts  # imports flax; `bytes` stays light

    config = preset(args.preset)
    try:
        n_params = parameter_counts(config)["total"]
    except ValueError as err:  # a preset for byte accounting only (v4_flash): no model to count
        print(f"v41jax mesh: error: --preset {args.preset}: {err}", file=sys.stderr)
        return 2
    plans = [accounting.plan_mesh(config, n_params, n, args.context) for n in args.devices]
    if args.json:
        summary = {"preset": args.preset, "n_params": n_params}
        print(json.dumps(summary | {"plans": accounting.mesh_summary(plans)}, indent=2))
        return 0
    print(tables.render_mesh_plan(args.preset, plans, n_params))
    return 0


def parse_device_counts(text: str) -> tuple[int, ...]:
    """`mesh --devices`: comma-separated GPU counts, each at most one node (8) or whole nodes."""
    node = accounting.H200.gpus_per_node
    counts = []
    for part in text.split(","):
        part = part.strip()
        n = int(part) if part.isdigit() else 0
        if n < 1 or (n > node and n % node):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated GPU counts, each from 1 to {node} or a multiple of "
                f"{node} (whole nodes), e.g. 8,64,512, got {text!r}"
            )
        counts.append(n)
    return tuple(counts)


def _train(args: argparse.Namespace) -> int:
    from v41jax import train  # imports jax/flax; `bytes` stays light

    # The named options are shorthands of --model-set: given, they win; not given (None), they
    # leave a --model-set of the same field as it is.
    named = {
        "kv_format": args.kv_format,
        "index_format": args.index_format,
        "block_score": args.block_score,
    }
    model = dict(args.model_set) | {k: v for k, v in named.items() if v is not None}
    try:
        cfg = train.make_config(
            preset=args.preset,
            task=args.task,
            steps=args.steps,
            batch_size=args.batch_size,
            learning_rate=args.lr,
            adam_b2=args.adam_b2,
            attention=args.attention,
            seed=args.seed,
            dense_warmup_steps=args.dense_warmup_steps,
            checkpoint_every=args.checkpoint_every,
            init_from=args.init_from,
            converge_accuracy=args.converge_accuracy,
            model_changes=model,
            task_changes=dict(args.task_set),
        )
    except ValueError as err:  # a bad value: a usage error, like argparse's own
        print(f"v41jax train: error: {err}", file=sys.stderr)
        return 2
    if args.group_size is not None and args.seeds is None:
        print("v41jax train: error: --group-size: expected --seeds with it", file=sys.stderr)
        return 2
    mesh = None
    if args.mesh is not None:
        if args.seeds is not None:
            print(
                "v41jax train: error: --mesh: one run at a time, not with --seeds", file=sys.stderr
            )
            return 2
        try:
            mesh = train.check_mesh(train.make_mesh(args.mesh), cfg)
        except ValueError as err:
            print(f"v41jax train: error: --mesh: {err}", file=sys.stderr)
            return 2
    if args.seeds is not None:
        return _train_seeds(args, [cfg.replace(seed=seed) for seed in args.seeds])
    out = args.out or _default_run_dir(cfg)
    if args.resume and not os.path.isfile(os.path.join(out, "config.json")):
        print(f"v41jax train: error: --resume: no run in {out} to continue", file=sys.stderr)
        return 2
    print(f"training {cfg.preset} on {cfg.task} for {cfg.steps} steps -> {out}")
    print(cfg.make_task().describe())
    try:
        result = train.run(
            cfg,
            out,
            resume=args.resume,
            max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
            mesh=mesh,
        )
    except train.RunDirectoryError as err:
        print(f"v41jax train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(train.summarize(cfg, out, result))
    return 0


def _train_seeds(args: argparse.Namespace, cfgs: list) -> int:
    """`train --seeds`: the runs of `cfgs` (one per seed) through `train.run_seeds`."""
    from v41jax import train

    cfg, seeds = cfgs[0], [c.seed for c in cfgs]
    out = args.out or _default_run_dir(cfg, seeds)
    held = [os.path.isfile(os.path.join(train.seed_dir(out, s), "config.json")) for s in seeds]
    if args.resume and not any(held):
        print(f"v41jax train: error: --resume: no seed's run in {out} to continue", file=sys.stderr)
        return 2
    try:
        groups = train.seed_groups(cfgs, args.group_size)
    except ValueError as err:
        print(f"v41jax train: error: {err}", file=sys.stderr)
        return 2
    together = ", ".join("{" + ", ".join(str(c.seed) for c in g) + "}" for g in groups)
    print(
        f"training {cfg.preset} on {cfg.task} for {cfg.steps} steps, seeds {together} "
        f"(each group in one program) -> {out}/seed<N>"
    )
    print(cfg.make_task().describe())
    try:
        results = train.run_seeds(
            cfgs,
            out,
            group_size=args.group_size,
            resume=args.resume,
            max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
        )
    except train.RunDirectoryError as err:
        print(f"v41jax train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    for c, result in zip(cfgs, results, strict=True):
        print(train.summarize(c, train.seed_dir(out, c.seed), result))
    print("\nseed   with the pool   same weights, dense")
    for c, result in zip(cfgs, results, strict=True):
        dense = result.get("dense_accuracy")
        dense_text = "n/a" if dense is None else f"{dense:.1%}"
        print(f"{c.seed:>4}   {result['accuracy']:>13.1%}   {dense_text:>19}")
    return 0


def parse_seeds(text: str) -> tuple[int, ...]:
    """`--seeds`: seeds as N, N-M (inclusive) or a comma-separated list of them ('0-4',
    '0,2,5', '0-2,7'); each seed at most once."""
    seeds: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            low, high = -1, -1
        if low < 0 or high < low:
            raise argparse.ArgumentTypeError(
                f"expected seeds as N, N-M or a comma-separated list of them (e.g. 0-4 or "
                f"0,2,5; integers >= 0, N <= M), got {text!r}"
            )
        seeds += range(low, high + 1)
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"expected each seed once, got {text!r} ({repeated} more than once)"
        )
    return tuple(seeds)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def name_value(text: str) -> tuple[str, object]:
    """Parses NAME=VALUE (`--task-set`, `--model-set`); VALUE is JSON when it parses as JSON,
    else a string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _mesh_shape(text: str) -> dict[str, int]:
    """`--mesh`: comma-separated AXIS=SIZE, e.g. data=2 or data=2,context=4."""
    shape = {}
    for part in text.split(","):
        axis, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected AXIS=SIZE[,AXIS=SIZE], got {text!r}")
        shape[axis.strip()] = int(size)
    return shape


def _minutes(text: str) -> float:
    """`--max-minutes`: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of minutes >= 0, got {text!r}")
    return value


def _default_run_dir(cfg, seeds: Sequence[int] | None = None) -> str:
    """runs/<preset>-<task>-<attention>-seed<N> for one run; -seeds<A-B> (a range) or
    -seeds<A,B,...> for a group's directory."""
    name = f"{cfg.preset}-{cfg.task}-{cfg.attention}"
    if seeds is None:
        return os.path.join("runs", f"{name}-seed{cfg.seed}")
    low, high = min(seeds), max(seeds)
    contiguous = list(seeds) == list(range(low, high + 1))
    label = f"{low}-{high}" if contiguous and high > low else ",".join(map(str, seeds))
    return os.path.join("runs", f"{name}-seeds{label}")


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
    parser.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="also the bytes each device receives with sequences sharded by position over N "
        "devices: per decoded token (top-k merges, remote KV rows) and per training step "
        "(all-gathers, reduce-scatters, window halos)",
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="v41jax",
        description="DeepSeek-V4.1's hierarchical sparse indexer and FP4 KV cache, in JAX. "
        "Without a command, runs `train` with its defaults (the main job).",
    )
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    bytes_parser = commands.add_parser(
        "bytes",
        aliases=["report"],
        help="global KV bytes per token and indexer multiply-adds, computed from the config",
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
    mesh_parser = commands.add_parser(
        "mesh",
        help="memory, bytes sent and time bounds of data × context meshes, and the chosen mesh",
        description="For each number of H200s, every data × context mesh (context a power of "
        "two): memory per device, bytes sent per training step and per decoded token over "
        "NVLink and InfiniBand, their time bounds against the compute bound, and the mesh chosen "
        "for training and for decode (the smallest context degree that fits; "
        "accounting.plan_mesh), all computed from the config and its parameter count.",
    )
    mesh_parser.add_argument(
        "--devices",
        type=parse_device_counts,
        default=(8, 64, 512),
        metavar="N[,N...]",
        help="GPU counts to plan for (default 8,64,512)",
    )
    mesh_parser.add_argument(
        "--context",
        type=_context,
        default=accounting.DEFAULT_CONTEXT,
        metavar="N",
        help="tokens per sequence: 65536, 64K, 1M (K = 1024; default 1M)",
    )
    mesh_parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="v41_flash", help="(v41_flash)"
    )
    mesh_parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    mesh_parser.set_defaults(run=_mesh)
    train_parser = commands.add_parser(
        "train",
        help="train a toy model with training-aware candidate pools and FP4 KV QAT (default)",
        description="Trains a preset on a retrieval task: a dense warm-up of the indexers, then "
        "sparse training with the candidate pool and Reindex top-k exactly as at inference, the "
        "main KV fake-quantized in its storage format (QAT). Writes config.json, metrics.jsonl, "
        "checkpoints and training.png to the run directory, and ends with a summary: accuracy "
        "with the pool vs dense attention, and pool recall against random, most-recent and "
        "oracle blocks. Ctrl-C saves a checkpoint; --resume continues.",
    )
    defaults = _train_defaults()
    train_parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (tiny)")
    train_parser.add_argument(
        "--task", choices=sorted(_train_tasks()), help=f"task ({defaults.task})"
    )
    train_parser.add_argument(
        "--task-set",
        action="append",
        default=[],
        type=name_value,
        metavar="NAME=VALUE",
        help="override a task field, e.g. --task-set seq_len=512 --task-set n_pairs=8",
    )
    train_parser.add_argument(
        "--model-set",
        action="append",
        default=[],
        type=name_value,
        metavar="NAME=VALUE",
        help="override a ModelConfig field of the preset, e.g. --model-set candidate_topk_blocks=8",
    )
    train_parser.add_argument("--steps", type=int, help=f"optimizer steps ({defaults.steps})")
    train_parser.add_argument("--batch-size", type=int, help=f"({defaults.batch_size})")
    train_parser.add_argument(
        "--lr", type=float, help=f"peak learning rate ({defaults.learning_rate})"
    )
    train_parser.add_argument(
        "--adam-b2", type=float, help=f"AdamW's second-moment decay ({defaults.adam_b2})"
    )
    train_parser.add_argument(
        "--dense-warmup-steps",
        type=int,
        help=f"indexer warm-up steps ({defaults.dense_warmup_steps})",
    )
    train_parser.add_argument(
        "--attention",
        choices=["sparse", "dense"],
        help="sparse (pool + top-k) or the dense baseline",
    )
    train_parser.add_argument(
        "--kv-format", choices=formats.formats_for("kv", quantizable=True), help="main KV (nvfp4)"
    )
    train_parser.add_argument(
        "--index-format", choices=formats.formats_for("index", quantizable=True), help="(mxfp4)"
    )
    train_parser.add_argument("--block-score", choices=tuple(BLOCK_REDUCERS), help="(max)")
    seed_options = train_parser.add_mutually_exclusive_group()
    seed_options.add_argument("--seed", type=int, help="init and data seed (0)")
    seed_options.add_argument(
        "--seeds",
        type=parse_seeds,
        metavar="SEEDS",
        help="train several seeds of the same run, e.g. 0-4 or 0,2,5: on a GPU in one program "
        "(a vmapped step over the stacked models), each seed in <out>/seed<N>/ as a single run",
    )
    train_parser.add_argument(
        "--group-size",
        type=_positive_int,
        metavar="N",
        help="with --seeds: seeds trained together in one program (default: all of them on a "
        "GPU, one at a time on the CPU); fewer need less device memory",
    )
    train_parser.add_argument(
        "--out",
        help="run directory (runs/<preset>-<task>-<attention>-seed<N>; with --seeds, "
        "runs/<preset>-<task>-<attention>-seeds<A-B> holding seed<N>/ for each seed)",
    )
    train_parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    train_parser.add_argument(
        "--mesh",
        type=_mesh_shape,
        metavar="data=N[,context=M]",
        help="train over N×M devices: each batch split over N (data parallel), each sequence "
        "into M contiguous slices (context parallel: seq_len a multiple of M × window_size); "
        "the state replicated",
    )
    train_parser.add_argument(
        "--converge-accuracy",
        type=float,
        metavar="ACC",
        help="stop once the last 2 evaluations of the final stage reach ACC (--steps is then "
        "a cap); a rule on the run's own evaluations, not on the machine (off)",
    )
    train_parser.add_argument(
        "--init-from",
        metavar="RUN_DIR",
        help="start from the weights of this run's latest checkpoint (same preset), with a "
        "fresh optimizer: a curriculum's next stage or a fine-tune; {seed} is replaced by the "
        "seed, e.g. runs/short/seed{seed} with --seeds",
    )
    train_parser.add_argument(
        "--checkpoint-every",
        type=int,
        help=f"steps between checkpoints ({defaults.checkpoint_every}; and at the end)",
    )
    train_parser.add_argument(
        "--max-minutes",
        type=_minutes,
        help="a guard, not a budget: stop training (with a checkpoint) after this long; --resume "
        "continues. The result then depends on the machine's speed. Default: no limit, the run "
        "is defined by its steps (0 = no limit)",
    )
    train_parser.set_defaults(run=_train)
    return parser


def _train_defaults():
    from v41jax import train

    return train.TrainConfig()


def _train_tasks():
    from v41jax.train import tasks

    return tasks.TASKS


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default: `sys.argv[1:]`); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["train"])
    if getattr(args, "max_minutes", None) == 0:
        args.max_minutes = None
    try:
        return args.run(args)
    except BrokenPipeError:  # `v41jax bytes | head`: stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
