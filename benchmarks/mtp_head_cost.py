"""One chained MTP draft step's parts timed side by side: the layer, and the LM head over every
token against a draft vocabulary's rows (alone, and scattered back into full-vocabulary rows).

    python benchmarks/mtp_head_cost.py M-full M-vocab

M-full: a target carrying an MTP layer (`train export`); M-vocab: the same exported with
`--draft-vocab N` (its config.json lists `mtp_draft_vocab`). One row, as a lone reply's chain.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on
import mlx.core as mx

from dflash_mlx import load, load_draft
from dflash_mlx.models.mtp import VOCAB_KEY
from dflash_mlx.models.target import TargetAdapter


def time_round(f: Callable[[], mx.array], rounds: list[float], calls: int = 200) -> None:
    """Append one round's mean milliseconds per call of `f` (after a warm-up)."""
    for _ in range(20):
        mx.eval(f())
    tic = time.perf_counter()
    for _ in range(calls):
        mx.eval(f())
    rounds.append((time.perf_counter() - tic) / calls * 1e3)


def main() -> None:
    full_dir, vocab_dir = sys.argv[1:3]
    model, _ = load(full_dir)
    target = TargetAdapter(model)
    draft = load_draft("mtp", target=full_dir)
    vocab = json.loads(open(f"{vocab_dir}/config.json").read())[VOCAB_KEY]
    full, restricted = target.draft_head(None), target.draft_head(vocab)
    x = mx.random.normal((1, 1, target.hidden_size))
    parts = {
        "layer step": lambda: draft.layers[0](x, None, None),
        f"head, {target.vocab_size} rows": lambda: mx.argmax(full(x), axis=-1),
        f"head, {len(vocab)} rows": lambda: restricted.ids[mx.argmax(restricted.rows(x), axis=-1)],
        f"head, {len(vocab)} rows scattered": lambda: mx.argmax(restricted(x), axis=-1),
    }
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(5):  # rounds, the parts interleaved
        for name, f in parts.items():
            time_round(f, times[name])
    for name, t in times.items():
        print(f"{name:40s} {min(t):.3f} ms (median {sorted(t)[2]:.3f})")


if __name__ == "__main__":
    main()
