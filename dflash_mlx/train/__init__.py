"""Train DFlash drafters: `dflash-mlx train data|features|fit|export`.

The stages run separately and each resumes where it stopped: `data` stores the
target's greedy replies to offline prompts as token ids (replies.jsonl);
`features` caches the target's hidden states of the tapped layers (fp16) for
every stored sequence; `fit` trains a drafter on random anchored blocks with a
block-sparse mask and checkpoints (ckpt/); `export` writes our layout with a
model card and the published layout. Everything large lives in the work dir
(default ~/.cache/dflash-mlx/train/<name>), never in the repository.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..draft import DFlashDraft
    from .trainer import DFlash2Shape

DEFAULT_TAPS = "1,8,14,20,27"
DFLASH2_FLAGS = {
    "conv_kernel_size": "taps of each in-block convolution",
    "conv_group_size": "channels sharing one dynamic kernel correction",
    "selector_top_k": "candidates per block position the selector chooses among",
    "selector_rank": "rank of the selector's codebooks",
    "sliding_window": "make every layer a sliding-window layer of this width",
}


def default_work_dir(name: str) -> Path:
    from ..paths import cache_dir

    return cache_dir() / "train" / name


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..session import add_trust_remote_code_argument

    sub = parser.add_subparsers(dest="stage", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="target dir or hub id (default: SmolLM2)")
    common.add_argument("--name", default="smollm2-135m-instruct", help="work dir name")
    common.add_argument("--work", default=None, help="work dir (default: cache/train/NAME)")
    add_trust_remote_code_argument(common)

    p = sub.add_parser("data", parents=[common], help="generate self-distillation replies")
    p.add_argument("--num-prompts", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("features", parents=[common], help="cache target hidden states")
    p.add_argument("--taps", type=_ints, default=_ints(DEFAULT_TAPS), help="target layer ids")
    p.add_argument("--batch-size", type=int, default=8)

    p = sub.add_parser("fit", parents=[common], help="train (resumes from WORK/ckpt)")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--init-layers", type=_ints, default=None, help="target layers to copy")
    p.add_argument(
        "--init-from",
        default=None,
        help="start from this drafter (e.g. a shipped one); --layers above its depth appends "
        "layers that start as the identity. Use an --lr near its final one (3e-4 for the "
        "shipped drafter): fresh AdamW moments at 1e-3 undid what it had learned",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--arch",
        choices=("dflash1", "dflash2"),
        default=None,
        help="dflash1 (default; with --init-from: that drafter's) or dflash2: convolutions "
        "around every sublayer and a candidate selector, trained with a selector loss",
    )
    from .trainer import DFlash2Shape, TrainConfig

    for field, text in DFLASH2_FLAGS.items():
        default = getattr(DFlash2Shape(), field)
        p.add_argument(
            f"--{field.replace('_', '-')}",
            type=int,
            default=None,
            help=f"{text} (dflash2; default {'off' if default is None else default})",
        )
    p.add_argument(
        "--selector-weight",
        type=float,
        default=None,
        help="weight of the selector loss next to the token loss (dflash2; default "
        f"{TrainConfig.selector_weight})",
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seqs-per-step", type=int, default=2)
    p.add_argument("--blocks-per-seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--gamma", type=float, default=7.0, help="loss decay w_k = exp(-(k-1)/gamma)")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument(
        "--soft-weight", type=float, default=0.5, help="share of the target's top-K soft labels"
    )
    p.add_argument("--full-vocab", action="store_true", help="softmax over the whole vocab")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-prompts", type=int, default=3)
    p.add_argument("--eval-max-tokens", type=int, default=64)
    p.add_argument(
        "--val-seqs", type=int, default=0, help="hold out the last N sequences for validation"
    )
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("export", parents=[common], help="write the trained drafter")
    p.add_argument("--out", required=True, help="our layout (with README.md model card)")
    p.add_argument("--published", default=None, help="also write the published layout here")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--card", default=None, help="model card markdown file (default: a stub)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="let the drafter propose only the N most frequent reply tokens (plus EOS and mask)",
    )


def work_dir(args: argparse.Namespace) -> Path:
    return Path(args.work).expanduser() if args.work else default_work_dir(args.name)


def load_target(args: argparse.Namespace):
    from .. import load
    from ..gguf import smollm2_model_dir

    return load(args.model or smollm2_model_dir(), trust_remote_code=args.trust_remote_code)


def dflash2_shape(args: argparse.Namespace) -> DFlash2Shape | None:
    """The `DFlash2Shape` that `--arch dflash2` and its flags ask for; None for DFlash 1."""
    from .trainer import DFlash2Shape

    given = [f for f in [*DFLASH2_FLAGS, "selector_weight"] if getattr(args, f) is not None]
    if args.arch != "dflash2":
        if given:
            flag = given[0].replace("_", "-")
            raise ValueError(f"--{flag} is a DFlash 2 setting: add --arch dflash2")
        return None
    return DFlash2Shape(**{f: getattr(args, f) for f in DFLASH2_FLAGS if f in given})


def arch_of(draft: DFlashDraft) -> str:
    return "dflash2" if draft.config.is_dflash2 else "dflash1"


def check_arch(draft: DFlashDraft, args: argparse.Namespace, source: str, hint: str = "") -> None:
    """`--arch` and the DFlash 2 shape flags, where given, must match the drafter that
    `source` holds (a checkpoint to resume, a DFlash 2 drafter to start from)."""
    if args.arch and args.arch != arch_of(draft):
        raise ValueError(f"{source} holds a {arch_of(draft)} drafter, not --arch {args.arch}{hint}")
    for field in DFLASH2_FLAGS:
        wanted, held = getattr(args, field), getattr(draft.config, field)
        if wanted is not None and wanted != held:
            flag = field.replace("_", "-")
            raise ValueError(
                f"{source} holds a drafter with {flag} {held}, not --{flag} {wanted}{hint}"
            )


def run(args: argparse.Namespace) -> None:
    work = work_dir(args)
    {"data": run_data, "features": run_features, "fit": run_fit, "export": run_export}[args.stage](
        args, work
    )


def run_data(args: argparse.Namespace, work: Path) -> None:
    from .data import extend_dataset
    from .prompts import build_prompts

    model, tokenizer = load_target(args)
    prompts = build_prompts(args.num_prompts, args.seed)
    extend_dataset(
        model, tokenizer, prompts, work / "replies.jsonl", args.max_tokens, args.batch_size
    )


def run_features(args: argparse.Namespace, work: Path) -> None:
    from .data import read_records
    from .features import cache_features

    model, _ = load_target(args)
    records = read_records(work / "replies.jsonl")
    n = cache_features(model, records, work / "features", args.taps, batch_size=args.batch_size)
    print(f"features cached for {n} of {len(records)} records in {work / 'features'}")


def run_fit(args: argparse.Namespace, work: Path) -> None:
    import mlx.core as mx
    import numpy as np

    from ..chat_format import render
    from .data import read_records
    from .features import cached_records, load_features
    from .prompts import build_prompts
    from .trainer import (
        Sequence,
        TrainConfig,
        Trainer,
        checkpoint_draft,
        decode_tau,
        finish_save,
        fit,
        grow_draft,
        make_draft,
        scale_fc_to_features,
    )

    shape = dflash2_shape(args)
    model, tokenizer = load_target(args)
    taps = json.loads((work / "features" / "meta.json").read_text())["target_layer_ids"]
    records = read_records(work / "replies.jsonl")
    records = records[: cached_records(work / "features", len(records))]
    features = load_features(work / "features", len(records))
    data = [Sequence(np.array(r["ids"]), r["start"], **f) for r, f in zip(records, features)]

    if not 0 <= args.val_seqs < len(data):
        raise ValueError(f"--val-seqs must be in [0, {len(data)}), got {args.val_seqs}")
    val = data[len(data) - args.val_seqs :] if args.val_seqs else []
    data = data[: len(data) - len(val)]
    print(
        f"{len(data)} sequences, {sum(len(s.ids) - s.start for s in data)} reply tokens; "
        f"{len(val)} held out for validation"
    )
    vocab = None if args.full_vocab else np.unique(np.concatenate([s.ids for s in data + val]))
    cfg = TrainConfig(
        steps=args.steps,
        seqs_per_step=args.seqs_per_step,
        blocks_per_seq=args.blocks_per_seq,
        lr=args.lr,
        warmup=args.warmup,
        clip=args.clip,
        gamma=args.gamma,
        soft_weight=args.soft_weight,
        selector_weight=(
            TrainConfig.selector_weight if args.selector_weight is None else args.selector_weight
        ),
        seed=args.seed,
        save_every=args.save_every,
        eval_every=args.eval_every,
    )
    ckpt = work / "ckpt"
    finish_save(ckpt)
    if ckpt.exists():  # the drafter the checkpoint holds, whatever --layers/--arch say
        draft, _ = checkpoint_draft(ckpt)
        check_arch(
            draft, args, str(ckpt), ": resume without that flag, or move ckpt/ away to start over"
        )
    elif args.init_from:
        from ..checkpoint import load_draft

        source = load_draft(args.init_from, dtype=mx.float32)
        if source.config.is_dflash2:
            check_arch(source, args, args.init_from)
        draft = grow_draft(source, args.layers, None if source.config.is_dflash2 else shape)
        if draft.config.target_layer_ids != taps:
            raise ValueError(
                f"{args.init_from} taps target layers {draft.config.target_layer_ids}, "
                f"the cached features are of layers {taps}"
            )
        print(
            f"starting from {args.init_from} ({arch_of(source)}, "
            f"{draft.config.num_hidden_layers} layers, now {arch_of(draft)})"
        )
    else:
        draft = make_draft(
            model, args.layers, taps, args.block_size, args.init_layers, args.seed, dflash2=shape
        )
    trainer = Trainer(model, draft, cfg, vocab)
    if ckpt.exists():
        trainer.load(ckpt)
        print(f"resumed from {ckpt} at step {trainer.step}")
    elif not args.init_from:
        scale_fc_to_features(draft, [s.features for s in data[:32]])
    seen = {tuple(r["ids"][: r["start"]]) for r in records}
    candidates = build_prompts(10 * args.eval_prompts, seed=args.seed + 1000)
    rendered = [render(tokenizer, p["prompt"], chat=True) for p in candidates]
    held_out = [ids for ids in rendered if tuple(ids) not in seen]

    def eval_fn(d):
        return decode_tau(model, d, tokenizer, held_out[: args.eval_prompts], args.eval_max_tokens)

    fit(trainer, data, ckpt, work / "train_log.jsonl", eval_fn, val)


def run_export(args: argparse.Namespace, work: Path) -> None:
    from .export import export_converted, export_published
    from .trainer import checkpoint_draft

    draft, step = checkpoint_draft(work / "ckpt")
    card = Path(args.card).read_text() if args.card else f"# DFlash drafter, step {step}\n"
    if args.draft_vocab:
        from mlx_lm.utils import load_tokenizer

        from ..gguf import smollm2_model_dir
        from ..loading import read_config, resolve_path
        from ..target import TARGET_PATTERNS
        from .data import read_records
        from .export import top_tokens

        target = resolve_path(args.model or smollm2_model_dir(), "target model", TARGET_PATTERNS)
        tokenizer = load_tokenizer(
            target,
            {"trust_remote_code": args.trust_remote_code},
            eos_token_ids=read_config(target).get("eos_token_id"),
        )
        always = [*tokenizer.eos_token_ids, draft.config.mask_token_id]
        records = read_records(work / "replies.jsonl")
        draft.config.draft_vocab = top_tokens(records, args.draft_vocab, always)
        print(f"draft vocabulary: {len(draft.config.draft_vocab)} tokens")
    print(f"wrote {export_converted(draft, Path(args.out), card, args.dtype)}")
    if args.published:
        print(f"wrote {export_published(draft, Path(args.published), args.dtype)}")
