"""Convert a drafter (published z-lab layout) to our layout: cast, optionally quantize.

dflash-mlx convert z-lab/Qwen3-4B-DFlash-b16 --out qwen3-4b-dflash -q --q-bits 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.nn as nn

from ..models.checkpoint import load_draft, save_draft, staged_dir
from ..models.loading import DTYPES

CARD = """# {name}

A DFlash block-diffusion drafter converted for [dflash-mlx](https://pypi.org/project/dflash-mlx/).

- source: `{source}`
- dtype: {dtype}; quantization: {quant}
- block size {block}, {layers} draft layers, target layers {ids}, mask token {mask}

```python
from dflash_mlx import load, load_draft, stream_generate
draft = load_draft("{name}")
```
"""


def convert_draft(
    source: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    q_bits: int | None = None,
    q_group_size: int = 64,
    force: bool = False,
) -> Path:
    """Write `source` in our layout; `q_bits` (4 or 8) quantizes the linear layers.

    `out_dir` must be empty or new unless `force`; it appears only once complete.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if q_bits is not None and q_bits not in (4, 8):
        raise ValueError(f"q_bits must be 4 or 8, got {q_bits}")
    if q_group_size not in (32, 64, 128):
        raise ValueError(f"q_group_size must be 32, 64 or 128, got {q_group_size}")
    model = load_draft(source, dtype=DTYPES[dtype])
    if q_bits is not None:
        nn.quantize(
            model,
            group_size=q_group_size,
            bits=q_bits,
            class_predicate=lambda _, m: (
                isinstance(m, nn.Linear) and m.weight.shape[-1] % q_group_size == 0
            ),
        )
        model.config.quantization = {"group_size": q_group_size, "bits": q_bits}
    cfg, out = model.config, Path(out_dir)
    card = CARD.format(
        name=out.name,
        source=source,
        dtype=dtype,
        quant=f"{q_bits}-bit, group {q_group_size}" if q_bits else "none",
        block=cfg.block_size,
        layers=cfg.num_hidden_layers,
        ids=cfg.target_layer_ids,
        mask=cfg.mask_token_id,
    )
    with staged_dir(out, force) as tmp:
        save_draft(model, tmp, card)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", nargs="?", help="drafter directory or hub id (published layout)")
    parser.add_argument("--gguf", help="import this GGUF target model instead of a drafter")
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=sorted(DTYPES), help="the drafter's dtype"
    )
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize linear layers")
    parser.add_argument(
        "--q-bits", type=int, default=4, choices=(4, 8), help="bits per weight with -q"
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        default=64,
        choices=(32, 64, 128),
        help="weights per quantization group with -q",
    )


def run(args: argparse.Namespace) -> None:
    if (args.gguf is None) == (args.source is None):
        raise ValueError("give either a drafter SOURCE or --gguf FILE")
    if args.gguf:
        from ..models.gguf import convert_gguf

        print(f"wrote {convert_gguf(args.gguf, args.out, force=args.force)}")
        return
    out = convert_draft(
        args.source,
        args.out,
        dtype=args.dtype,
        q_bits=args.q_bits if args.quantize else None,
        q_group_size=args.q_group_size,
        force=args.force,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    from . import run_as_module

    run_as_module("convert")
