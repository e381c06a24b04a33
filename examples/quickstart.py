"""Stream an answer with DFlash speculative decoding (the README's quick start as a script).

    python examples/quickstart.py
    python examples/quickstart.py --model Qwen/Qwen3-4B --draft z-lab/Qwen3-4B-DFlash-b16

Without --model it runs SmolLM2-135M-Instruct (fetched once) with the drafter shipped in
this repository, as `dflash-mlx demo` does. The reply streams, then mlx-lm's stats lines
and one on what drafting did.
"""

import argparse

from dflash_mlx import generate, load, load_draft
from dflash_mlx.cli.demo import demo_paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm target: local dir or hub id (default: SmolLM2)")
    parser.add_argument("--draft", help="DFlash drafter made for it (default: SmolLM2's)")
    parser.add_argument("--prompt", default="Write a Python function that checks for primes.")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if (args.model is None) != (args.draft is None):
        parser.error("give --model and --draft together (a drafter is made for one target)")
    model_dir, draft_dir = (args.model, args.draft) if args.model else demo_paths()

    model, tokenizer = load(model_dir)
    draft = load_draft(draft_dir)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # token ids
    generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, verbose=True)


if __name__ == "__main__":
    main()
