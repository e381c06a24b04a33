"""Train DFlash drafters: `dflash-mlx train data|features|fit|export|finetune`.

The stages run separately and each resumes where it stopped: `data` stores the
target's greedy replies to offline prompts (or to a user's conversations, or takes the
replies a server recorded) as token ids (replies.jsonl);
`features` caches the target's hidden states of the tapped layers (fp16) for
every stored sequence; `fit` trains a drafter (DFlash 1, DFlash 2 or DSpark: `--arch`)
on random anchored blocks with a block-sparse mask, or the target's own MTP layer
(`--arch mtp`, `mtp.py`), and checkpoints (ckpt/); `export` writes our layout with a
model card and the published layout (an MTP layer: the target carrying it); `finetune` runs the four
on a user's own traffic, from a drafter they have. Everything large lives
in the work dir (default ~/.cache/dflash-mlx/train/<name>), never in the repository.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..models.draft import DFlashDraft
    from ..models.mtp import MTPDraft
    from .trainer import DraftShape

DEFAULT_TAPS = "1,8,14,20,27"
DFLASH2_FLAGS = {
    "conv_kernel_size": "taps of each in-block convolution",
    "conv_group_size": "channels sharing one dynamic kernel correction",
    "selector_top_k": "candidates per block position the selector chooses among",
    "selector_rank": "rank of the selector's codebooks",
    "sliding_window": "make every layer a sliding-window layer of this width",
}
DSPARK_FLAGS = {
    "markov_rank": ("rank of the Markov head's W1/W2; 0: none", int),
    "markov_head": ("Markov head: vanilla, gated or rnn", str),
    "confidence_head": ("confidence head input: markov ([h; W1[prev]]), hidden (h) or off", str),
}
DSPARK_WEIGHTS = {
    "ce_weight": "weight of the cross-entropy",
    "l1_weight": "weight of the L1 distance to the target's distribution",
    "confidence_weight": "weight of the confidence head's binary cross-entropy",
}
ARCH_FLAGS = {
    "dflash2": ("DFlash 2", [*DFLASH2_FLAGS, "selector_weight"]),
    "dspark": ("DSpark", [*DSPARK_FLAGS, *DSPARK_WEIGHTS]),
}


def default_work_dir(name: str) -> Path:
    from ..paths import cache_dir

    return cache_dir() / "train" / name


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..options import add_trust_remote_code_argument

    sub = parser.add_subparsers(dest="stage", required=True, help="the stage to run")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="target dir or hub id (default: SmolLM2)")
    common.add_argument("--name", default="smollm2-135m-instruct", help="work dir name")
    common.add_argument("--work", default=None, help="work dir (default: cache/train/NAME)")
    add_trust_remote_code_argument(common)

    p = sub.add_parser("data", parents=[common], help="generate self-distillation replies")
    p.add_argument("--num-prompts", type=int, default=3000, help="prompts to reply to")
    p.add_argument("--max-tokens", type=int, default=192, help="most tokens per reply")
    p.add_argument("--batch-size", type=int, default=32, help="replies decoded in lockstep")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts drawn")
    add_source_argument(p, required=False)

    p = sub.add_parser("features", parents=[common], help="cache target hidden states")
    p.add_argument("--taps", type=_ints, default=_ints(DEFAULT_TAPS), help="target layer ids")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")

    p = sub.add_parser("fit", parents=[common], help="train (resumes from WORK/ckpt)")
    p.add_argument("--layers", type=int, default=None, help="draft layers (default 2; mtp: 1)")
    p.add_argument(
        "--init-layers", type=_ints, default=None, help="target layers to copy (mtp: one)"
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="start from this drafter (e.g. a shipped one); --layers above its depth appends "
        "layers that start as the identity. Use an --lr near its final one (3e-4 for the "
        "shipped drafter): fresh AdamW moments at 1e-3 undid what it had learned",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="positions a cycle verifies (default 16; DSpark: its slots γ = block size - 1 each "
        "draft; mtp: 4, the root and the chain that validation walks)",
    )
    p.add_argument(
        "--arch",
        choices=("dflash1", "dflash2", "dspark", "mtp"),
        default=None,
        help="dflash1 (default; with --init-from: that drafter's), dflash2: convolutions "
        "around every sublayer and a candidate selector, trained with a selector loss, "
        "dspark: a Markov and a confidence head, trained with DeepSpec's loss (a DFlash 1 "
        "--init-from keeps its slots: slot 0 drafts nothing), or mtp: the target's own "
        "multi-token-prediction layer (DeepSeek-V3's recipe, `--draft mtp`; it reads the "
        "target's final hidden states, not --taps, and every reply position is a label)",
    )
    from .dspark import DSparkShape
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
    for field, (text, kind) in DSPARK_FLAGS.items():
        p.add_argument(
            f"--{field.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"{text} (dspark; default {getattr(DSparkShape(), field)})",
        )
    for field, text in DSPARK_WEIGHTS.items():
        p.add_argument(
            f"--{field.replace('_', '-')}",
            type=float,
            default=None,
            help=f"{text} (dspark; default {getattr(TrainConfig, field)}, DeepSpec's)",
        )
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps in all")
    p.add_argument("--seqs-per-step", type=int, default=2, help="sequences per step")
    p.add_argument("--blocks-per-seq", type=int, default=32, help="blocks drawn per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=100, help="steps of learning-rate warm-up")
    p.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="loss decay w_k = exp(-(k-1)/gamma) (default 7; dspark: 4, DeepSpec's)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument(
        "--soft-weight",
        type=float,
        default=None,
        help="share of the target's top-K soft labels (default 0.5; not dspark's: its L1 "
        "term matches the target's whole distribution)",
    )
    p.add_argument("--full-vocab", action="store_true", help="softmax over the whole vocab")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=250, help="steps between evaluations")
    p.add_argument("--eval-prompts", type=int, default=3, help="prompts per evaluation")
    p.add_argument("--eval-max-tokens", type=int, default=64, help="tokens per evaluation reply")
    p.add_argument(
        "--val-seqs", type=int, default=0, help="hold out the last N sequences for validation"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the drafter's initialisation and the batches"
    )

    p = sub.add_parser("export", parents=[common], help="write the trained drafter")
    p.add_argument(
        "--out",
        required=True,
        help="our layout (with README.md model card); an MTP layer: the target's checkpoint "
        "carrying it (`--model OUT --draft mtp`)",
    )
    p.add_argument("--published", default=None, help="also write the published layout here")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "float16", "bfloat16"),
        help="the drafter's dtype",
    )
    p.add_argument("--card", default=None, help="model card markdown file (default: a stub)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="let the drafter propose only the N most frequent reply tokens (plus EOS, mask "
        "and the tokens of the vocabulary of the drafter it was fine-tuned from, if any; an "
        "MTP layer: listed in the target's config.json as mtp_draft_vocab)",
    )

    p = sub.add_parser(
        "finetune",
        parents=[common],
        help="fine-tune a drafter on recorded traffic or your conversations",
        description="data, features, fit and export in one go: the target's replies from "
        "SOURCE, a drafter fine-tuned on them from --draft, written to --out. Validation "
        "holds out the newest replies and reports the drafter's tau on them before and after.",
    )
    add_source_argument(p, required=True)
    p.add_argument("--draft", required=True, help="the drafter to start from (dir or hub id)")
    p.add_argument(
        "--out",
        required=True,
        help="where to write the fine-tuned drafter (the run's work dir, unless --work: "
        "cache/train/finetune-<its name>)",
    )
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the replies")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    p.add_argument("--val-seqs", type=int, default=None, help="replies held out (default 10%%)")
    p.add_argument("--max-tokens", type=int, default=192, help="most tokens per new reply")
    p.add_argument("--batch-size", type=int, default=32, help="replies decoded in lockstep")


def add_source_argument(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "--from",
        dest="source",
        required=required,
        help="a `serve --record` directory (its replies are taken as they are) or a JSONL file "
        'of chat conversations ({"messages": [...]} or {"prompt": "..."} per line; the target '
        'replies to each, up to its last user turn), texts ({"text": "..."}: windows of '
        "256 tokens, on which a drafter learns the target's greedy path through them) and "
        "another run's replies.jsonl records; .xz and .gz files are read decompressed",
    )


def work_dir(args: argparse.Namespace) -> Path:
    return Path(args.work).expanduser() if args.work else default_work_dir(args.name)


def load_target(args: argparse.Namespace):
    from .. import load
    from ..models.gguf import smollm2_model_dir

    return load(args.model or smollm2_model_dir(), trust_remote_code=args.trust_remote_code)


def target_dir(args: argparse.Namespace) -> Path:
    """The target checkpoint's directory (a hub id fetched)."""
    from ..models.gguf import smollm2_model_dir
    from ..models.loading import resolve_path
    from ..models.target import TARGET_PATTERNS

    return resolve_path(args.model or smollm2_model_dir(), "target model", TARGET_PATTERNS)


def start_mtp(args: argparse.Namespace, model, ckpt: Path) -> MTPDraft:
    """The MTP layer `fit --arch mtp` trains: the checkpoint's, or a new one (`--init-layers`:
    a copy of that target layer)."""
    from ..models.mtp import DEFAULT_BLOCK_SIZE
    from .mtp import checkpoint_mtp, is_mtp_checkpoint, make_mtp

    if ckpt.exists():
        if not is_mtp_checkpoint(ckpt):
            raise ValueError(
                f"{ckpt} holds a DFlash drafter, not --arch mtp: resume without that flag, or "
                "move ckpt/ away to start over"
            )
        if args.arch not in (None, "mtp"):
            raise ValueError(f"{ckpt} holds an MTP layer, not --arch {args.arch}")
        return checkpoint_mtp(ckpt, target_dir(args))[0]
    if args.init_from:
        raise ValueError("--arch mtp starts a new layer: --init-layers copies a target layer")
    if args.layers not in (None, 1) or len(args.init_layers or [0]) != 1:
        raise ValueError("--arch mtp trains one layer: give --init-layers one target layer id")
    init = args.init_layers[0] if args.init_layers else None
    block = args.block_size or DEFAULT_BLOCK_SIZE
    return make_mtp(target_dir(args), model, args.seed, init, block)


def arch_shape(args: argparse.Namespace) -> DraftShape | None:
    """The shape that `--arch dflash2` or `--arch dspark` and their flags ask for; None for
    DFlash 1. A flag of another architecture is refused."""
    from .dspark import DSparkShape
    from .trainer import DFlash2Shape

    for arch, (name, flags) in ARCH_FLAGS.items():
        given = [f for f in flags if getattr(args, f) is not None]
        if given and args.arch != arch:
            flag = given[0].replace("_", "-")
            raise ValueError(f"--{flag} is a {name} setting: add --arch {arch}")
    if args.arch == "dflash2":
        return DFlash2Shape(**given_flags(args, DFLASH2_FLAGS))
    if args.arch == "dspark":
        return DSparkShape(**given_flags(args, DSPARK_FLAGS))
    return None


def given_flags(args: argparse.Namespace, flags: dict | list) -> dict:
    return {f: getattr(args, f) for f in flags if getattr(args, f) is not None}


def loss_settings(args: argparse.Namespace, arch: str) -> dict:
    """The `TrainConfig` loss fields for a drafter of `arch`: the flags given, else that
    architecture's defaults (DSpark: DeepSpec's decay 4 and no soft labels)."""
    if arch == "dspark" and args.soft_weight is not None:
        raise ValueError(
            "--soft-weight is no part of DSpark's loss: its L1 term already compares the "
            "drafter's distribution with the target's whole one"
        )
    dspark = arch == "dspark"
    return {
        "gamma": args.gamma if args.gamma is not None else 4.0 if dspark else 7.0,
        "soft_weight": 0.0 if dspark else 0.5 if args.soft_weight is None else args.soft_weight,
        **given_flags(args, [*DSPARK_WEIGHTS, "selector_weight"]),
    }


def arch_of(draft: DFlashDraft | MTPDraft) -> str:
    from ..models.dspark import DSparkConfig
    from ..models.mtp import MTPConfig

    if isinstance(draft.config, MTPConfig):
        return "mtp"
    if isinstance(draft.config, DSparkConfig):
        return "dspark"
    return "dflash2" if draft.config.is_dflash2 else "dflash1"


def held_settings(draft: DFlashDraft) -> dict:
    """The shape flags' values that `draft` has (DFlash 2's, and DSpark's for a DSpark one)."""
    from .dspark import DSparkShape

    held = {f: getattr(draft.config, f) for f in DFLASH2_FLAGS}
    if arch_of(draft) == "dspark":
        held.update({f: getattr(DSparkShape.of(draft.config), f) for f in DSPARK_FLAGS})
    return held


def check_arch(draft: DFlashDraft, args: argparse.Namespace, source: str, hint: str = "") -> None:
    """`--arch` and the shape flags, where given, must match the drafter that `source` holds
    (a checkpoint to resume, a DFlash 2 or DSpark drafter to start from)."""
    if args.arch and args.arch != arch_of(draft):
        raise ValueError(f"{source} holds a {arch_of(draft)} drafter, not --arch {args.arch}{hint}")
    for field, held in held_settings(draft).items():
        wanted = getattr(args, field)
        if wanted is not None and wanted != held:
            flag = field.replace("_", "-")
            raise ValueError(
                f"{source} holds a drafter with {flag} {held}, not --{flag} {wanted}{hint}"
            )


def run(args: argparse.Namespace) -> None:
    stages = {
        "data": run_data,
        "features": run_features,
        "fit": run_fit,
        "export": run_export,
        "finetune": run_finetune,
    }
    if args.stage == "finetune" and not args.work:  # not the pool's data: a run of its own
        args.work = str(default_work_dir(f"finetune-{Path(args.out).name}"))
    stages[args.stage](args, work_dir(args))


def run_data(args: argparse.Namespace, work: Path) -> None:
    from .data import conversation_prompts, extend_dataset, import_records, text_records
    from .prompts import build_prompts

    source = Path(args.source).expanduser() if args.source else None
    if source is not None and not source.exists():
        raise FileNotFoundError(f"--from {args.source}: no such file or directory")
    if source is None:
        prompts = build_prompts(args.num_prompts, args.seed)
    elif source.is_file():  # checked before anything is loaded
        prompts = conversation_prompts(source)
        kept = [p["record"] for p in prompts if "record" in p]
        if kept:  # token ids already: no target needed
            added = import_records(kept, work / "replies.jsonl")
            print(f"{added} stored replies added -> {work / 'replies.jsonl'}")
        prompts = [p for p in prompts if "record" not in p]
        if not prompts:
            return
    model, tokenizer = load_target(args)
    if source is not None and source.is_dir():
        import_recorded(source, model, work / "replies.jsonl")
        return
    texts = [p for p in prompts if "text" in p]
    if texts:
        records = [r for item in texts for r in text_records(tokenizer, item)]
        added = import_records(records, work / "replies.jsonl")
        print(f"{added} windows of {len(texts)} texts added -> {work / 'replies.jsonl'}")
    prompts = [p for p in prompts if "text" not in p]
    if not prompts:
        return
    extend_dataset(
        model, tokenizer, prompts, work / "replies.jsonl", args.max_tokens, args.batch_size
    )


def import_recorded(source: Path, model, path: Path) -> None:
    """Take the replies a server recorded into `source`, if the same target wrote them."""
    from ..models.target import TargetAdapter
    from .data import import_records, read_records

    meta = source / "meta.json"
    if not (source / "replies.jsonl").exists():
        raise FileNotFoundError(f"--from {source}: no replies.jsonl (record with serve --record)")
    if meta.exists():
        recorded = json.loads(meta.read_text()).get("vocab_size")
        vocab = TargetAdapter(model).vocab_size
        if recorded != vocab:
            raise ValueError(
                f"--from {source}: its replies are token ids of a target with a vocabulary of "
                f"{recorded}, this one has {vocab}: give the --model that served them"
            )
    added = import_records(read_records(source / "replies.jsonl"), path)
    print(f"{added} recorded replies added -> {path}")


def run_features(args: argparse.Namespace, work: Path) -> None:
    from .data import read_records
    from .features import cache_features

    model, _ = load_target(args)
    records = read_records(work / "replies.jsonl")
    n = cache_features(model, records, work / "features", args.taps, batch_size=args.batch_size)
    print(f"features cached for {n} of {len(records)} records in {work / 'features'}")


def run_fit(args: argparse.Namespace, work: Path) -> None:
    from dataclasses import replace

    import mlx.core as mx
    import numpy as np

    from ..chat_format import render
    from .data import read_records
    from .dspark import DSparkShape, DSparkTrainer
    from .features import cached_records, load_features
    from .mtp import MTPTrainer, is_mtp_checkpoint
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
        label_vocab,
        make_draft,
        scale_fc_to_features,
    )

    shape = arch_shape(args)
    model, tokenizer = load_target(args)
    taps = json.loads((work / "features" / "meta.json").read_text())["target_layer_ids"]
    records = read_records(work / "replies.jsonl")
    records = records[: cached_records(work / "features", len(records))]
    features = load_features(work / "features", len(records))
    data = [
        Sequence(np.array(r["ids"]), r["start"], **f, greedy=r.get("greedy", True))
        for r, f in zip(records, features)
    ]

    teaching = [s for s in data if len(s.anchors())]
    if len(teaching) < len(data):
        print(
            f"{len(data) - len(teaching)} sequences of text left out: the target would choose "
            "none of their tokens itself, so they teach a drafter nothing"
        )
        data = teaching
    if not 0 <= args.val_seqs < len(data):
        raise ValueError(f"--val-seqs must be in [0, {len(data)}), got {args.val_seqs}")
    val = data[len(data) - args.val_seqs :] if args.val_seqs else []
    data = data[: len(data) - len(val)]
    print(
        f"{len(data)} sequences, {sum(len(s.ids) - s.start for s in data)} reply tokens; "
        f"{len(val)} held out for validation"
    )
    vocab = None if args.full_vocab else label_vocab(data + val)
    ckpt = work / "ckpt"
    finish_save(ckpt)
    if args.arch == "mtp" or is_mtp_checkpoint(ckpt):
        draft = start_mtp(args, model, ckpt)
    elif ckpt.exists():  # the drafter the checkpoint holds, whatever --layers/--arch say
        draft, _ = checkpoint_draft(ckpt)
        check_arch(
            draft, args, str(ckpt), ": resume without that flag, or move ckpt/ away to start over"
        )
    elif args.init_from:
        from ..models.checkpoint import load_draft

        source = load_draft(args.init_from, dtype=mx.float32)
        if arch_of(source) != "dflash1":  # it keeps its own shape
            check_arch(source, args, args.init_from)
            shape = None
        elif isinstance(shape, DSparkShape):
            shape = replace(shape, from_anchor=False)  # DFlash's slots, as it was trained
        draft = grow_draft(source, args.layers or 2, shape)
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
            model,
            args.layers or 2,
            taps,
            args.block_size or 16,
            args.init_layers,
            args.seed,
            shape=shape,
        )
    cfg = TrainConfig(
        steps=args.steps,
        seqs_per_step=args.seqs_per_step,
        blocks_per_seq=args.blocks_per_seq,
        lr=args.lr,
        warmup=args.warmup,
        clip=args.clip,
        seed=args.seed,
        save_every=args.save_every,
        eval_every=args.eval_every,
        **loss_settings(args, arch_of(draft)),
    )
    trainers = {"dspark": DSparkTrainer, "mtp": MTPTrainer}
    trainer = trainers.get(arch_of(draft), Trainer)(model, draft, cfg, vocab)
    if ckpt.exists():
        trainer.load(ckpt)
        print(f"resumed from {ckpt} at step {trainer.step}")
    elif not args.init_from and arch_of(draft) != "mtp":
        scale_fc_to_features(draft, [s.features for s in data[:32]])
    seen = {tuple(r["ids"][: r["start"]]) for r in records}
    candidates = build_prompts(10 * args.eval_prompts, seed=args.seed + 1000)
    rendered = [render(tokenizer, p["prompt"], chat=True) for p in candidates]
    held_out = [ids for ids in rendered if tuple(ids) not in seen]

    def eval_fn(d):
        return decode_tau(model, d, tokenizer, held_out[: args.eval_prompts], args.eval_max_tokens)

    fit(trainer, data, ckpt, work / "train_log.jsonl", eval_fn if args.eval_prompts else None, val)


def run_export(args: argparse.Namespace, work: Path) -> None:
    from .export import export_converted, export_published
    from .mtp import is_mtp_checkpoint
    from .trainer import checkpoint_draft, finish_save

    finish_save(work / "ckpt")
    if is_mtp_checkpoint(work / "ckpt"):
        run_export_mtp(args, work)
        return
    draft, step = checkpoint_draft(work / "ckpt")
    if args.published and arch_of(draft) == "dspark":
        raise ValueError(
            "--published writes z-lab's DFlash layout; a DSpark drafter's is the one --out "
            "writes (DSparkDraftModel)"
        )
    name = {"dflash1": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}[arch_of(draft)]
    card = Path(args.card).read_text() if args.card else f"# {name} drafter, step {step}\n"
    if args.draft_vocab:
        # a drafter fine-tuned from one with a draft vocabulary keeps it, and adds the new
        # data's most frequent tokens
        always = [draft.config.mask_token_id, *(draft.config.draft_vocab or [])]
        draft.config.draft_vocab = export_vocab(args, work, target_dir(args), always)
    print(f"wrote {export_converted(draft, Path(args.out), card, args.dtype)}")
    if args.published:
        print(f"wrote {export_published(draft, Path(args.published), args.dtype)}")


def export_vocab(
    args: argparse.Namespace, work: Path, target: Path, always: list[int]
) -> list[int]:
    """`--draft-vocab N`: the EOS tokens of the target at `target`, `always`, and the most
    frequent tokens of the work dir's replies, N in all (`export.top_tokens`)."""
    from mlx_lm.utils import load_tokenizer

    from ..models.loading import read_config
    from .data import read_records
    from .export import top_tokens

    tokenizer = load_tokenizer(
        target,
        {"trust_remote_code": args.trust_remote_code},
        eos_token_ids=read_config(target).get("eos_token_id"),
    )
    records = read_records(work / "replies.jsonl")
    vocab = top_tokens(records, args.draft_vocab, [*tokenizer.eos_token_ids, *always])
    print(f"draft vocabulary: {len(vocab)} tokens")
    return vocab


def run_export_mtp(args: argparse.Namespace, work: Path) -> None:
    """The target's checkpoint carrying the trained MTP layer (`mtp.export_mtp`), with its
    draft vocabulary (`--draft-vocab`) if asked."""
    from .mtp import MTP_FILE, checkpoint_mtp, export_mtp

    if args.published:
        raise ValueError(
            "--published is for DFlash drafters: an MTP layer is written in the layout "
            "DeepSeek-V3 checkpoints carry theirs"
        )
    target = target_dir(args)
    draft, step = checkpoint_mtp(work / "ckpt", target)
    if args.draft_vocab:
        draft.config.draft_vocab = export_vocab(args, work, target, [])
    card = Path(args.card).read_text() if args.card else f"# MTP layer, step {step}\n"
    out = export_mtp(draft, target, Path(args.out), card, args.dtype)
    print(f"wrote {out} (the target, its MTP layer in {MTP_FILE}; --model {out} --draft mtp)")


def run_finetune(args: argparse.Namespace, work: Path) -> None:
    """`data --from`, `features` at the drafter's taps, `fit --init-from` for `--epochs` over
    the replies, `export`: each stage as its own command would run it, so a run cut short
    resumes, and `fit`'s log holds the validation before and after."""
    from ..models.checkpoint import load_draft
    from .data import read_records
    from .features import cached_records

    common = ["--work", str(work)]
    if args.model:
        common += ["--model", args.model]
    if args.trust_remote_code:
        common.append("--trust-remote-code")
    source = load_draft(args.draft)
    taps = ",".join(map(str, source.config.target_layer_ids))
    vocab = len(source.config.draft_vocab or [])
    del source
    stage(["data", "--from", args.source, "--max-tokens", str(args.max_tokens),
           "--batch-size", str(args.batch_size), *common])  # fmt: skip
    stage(["features", "--taps", taps, *common])
    records = read_records(work / "replies.jsonl")
    usable = cached_records(work / "features", len(records))
    val = args.val_seqs if args.val_seqs is not None else max(1, usable // 10)
    if usable - val < 1:
        raise ValueError(
            f"{len(records)} replies, features for {usable} of them (whole chunks of 64): "
            f"too few to fine-tune on with {val} held out; record or give more"
        )
    steps = max(1, round(args.epochs * (usable - val) / 2))  # 2 sequences per step
    fit_log = work / "train_log.jsonl"
    if (work / "ckpt").exists():
        steps = max(steps, checkpoint_step(work / "ckpt"))
    stage(["fit", "--init-from", args.draft, "--steps", str(steps), "--lr", str(args.lr),
           "--warmup", str(min(20, steps // 5)), "--val-seqs", str(val),
           "--eval-every", str(steps), "--eval-prompts", "0", "--save-every", "50",
           *common])  # fmt: skip
    before, after = validation_taus(fit_log)
    card = work / "card.md"
    card.write_text(
        f"# Drafter fine-tuned from {args.draft}\n\n"
        f"`dflash-mlx train finetune --from {args.source}`: {usable - val} replies, "
        f"{steps} steps at lr {args.lr}; validation tau on {val} held-out replies "
        f"{before:.2f} before, {after:.2f} after.\n"
    )
    export = ["export", "--out", args.out, "--card", str(card), *common]
    stage(export + (["--draft-vocab", str(vocab)] if vocab else []))
    print(f"validation tau on {val} held-out replies: {before:.2f} -> {after:.2f}")


def stage(argv: list[str]) -> None:
    """Run one `dflash-mlx train` stage as its command line would."""
    parser = argparse.ArgumentParser(prog="dflash-mlx train")
    add_arguments(parser)
    args = parser.parse_args(argv)
    print(f"== dflash-mlx train {' '.join(argv)}", flush=True)
    run(args)


def checkpoint_step(ckpt: Path) -> int:
    return json.loads((ckpt / "state.json").read_text())["step"]


def validation_taus(log: Path) -> tuple[float, float]:
    """The first and the last validation tau (along decoding's path) of a `fit` log."""
    taus = [
        json.loads(line)["val"]["tau_decode"]
        for line in log.read_text().splitlines()
        if '"val"' in line
    ]
    return taus[0], taus[-1]
