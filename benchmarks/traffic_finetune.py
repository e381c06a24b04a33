"""A drafter that learns from the traffic it serves, measured: the shipped SmolLM2 drafter on
a domain it was not trained on (questions asked in French), before and after
`dflash-mlx train finetune` on the replies a `dflash-mlx serve --record` run kept.

    python benchmarks/traffic_finetune.py --clients 8 --max-tokens 96 --epochs 3

1. serve SmolLM2-135M-Instruct with the shipped drafter and `--record`; `--clients` threads
   of the `openai` client ask the training questions (greedy). With `--via conversations` the
   same questions go into a JSONL file of conversations and `train data --from` it has the
   target reply in lockstep batches: the same greedy replies (tests/test_traffic.py checks
   that a recorded reply is the target's greedy one), made faster than a server does;
2. `dflash-mlx train finetune --from` them (its wall and CPU time: features, fit, export);
3. tau of real greedy decoding (chains of 16, as training validates) on held-out questions
   about subjects no training question names, with the shipped and the fine-tuned drafter,
   and on English questions of the training pool's held-out draw (what the fine-tune costs
   where the drafter was good); every reply checked equal to the target's own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dflash_mlx  # noqa: F401  (binds the fast CPU BLAS before mlx loads)
from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.chat_format import render
from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.train.prompts import build_prompts

SHIPPED = Path(dflash_mlx.__file__).parent / "drafters" / "smollm2-135m-instruct"

FRAMES = [
    "Explique-moi {} en quelques phrases.",
    "Quelles sont les idées essentielles à retenir sur {} ?",
    "Écris un court paragraphe sur {}.",
    "Résume {} pour un enfant de dix ans.",
    "Donne-moi trois faits intéressants sur {}.",
    "Quelle est l'histoire de {} ?",
]
SUBJECTS = [
    "la photosynthèse", "le cycle de l'eau", "la Révolution française", "les volcans",
    "le système solaire", "la gravité", "les abeilles", "la démocratie", "le chocolat",
    "les marées", "la musique classique", "les dinosaures", "l'électricité", "le Moyen Âge",
    "les océans", "la peinture impressionniste", "le vélo", "les vaccins", "le pain",
    "la Tour Eiffel", "les forêts tropicales", "le fromage", "les étoiles", "la poésie",
    "les ordinateurs", "le football", "la lune", "les pyramides d'Égypte", "le café",
    "les baleines", "l'écriture", "les saisons", "le cinéma", "les montagnes", "la météo",
    "les jeux olympiques", "le recyclage", "les champignons", "l'imprimerie", "les fourmis",
    "le théâtre", "les glaciers", "la monnaie", "les châteaux forts", "le jardinage",
    "les tremblements de terre", "la langue française", "les trains",
]  # fmt: skip
HELD_OUT_SUBJECTS = [
    "les arcs-en-ciel", "le miel", "les pirates", "la boussole", "les éclipses",
    "le thé", "les déserts", "les phares",
]  # fmt: skip


def questions(subjects: list[str], frames: list[str]) -> list[str]:
    return [frame.format(subject) for subject in subjects for frame in frames]


def record_traffic(args: argparse.Namespace, record: Path, asked: list[str]) -> float:
    """Serve with `--record` and ask every question; the seconds it took."""
    import openai

    port = 8790
    cmd = [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(smollm2_model_dir()),
           "--draft", str(SHIPPED), "--record", str(record), "--port", str(port),
           "--max-batch", str(args.clients)]  # fmt: skip
    log = open(record.parent / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=20)
    try:
        while True:
            try:
                name = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                time.sleep(1)
        tic = time.perf_counter()

        def ask(question: str) -> None:
            client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": question}],
                max_tokens=args.max_tokens,
                temperature=0,
            )

        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(ask, asked))
        return time.perf_counter() - tic
    finally:
        server.terminate()
        server.wait()


def taus(model, tokenizer, drafts: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    """Per drafter, the mean over prompts of greedy decoding's tau in chains of 16 (committed
    tokens per cycle after the prefill's, as training's `decode_tau`), after checking that
    each reply equals the target's own."""
    plain = [
        [t for r in stream_generate(model, None, tokenizer, p, max_tokens=max_tokens)
         for t in r.tokens]
        for p in prompts
    ]  # fmt: skip
    out = {}
    for name, draft in drafts.items():
        per_prompt = []
        for p, expected in zip(prompts, plain):
            responses = list(
                stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens, block_size=16)
            )
            assert [t for r in responses for t in r.tokens] == expected, f"{name}: not lossless"
            tokens = responses[-1].generation_tokens
            per_prompt.append((tokens - 1) / max(len(responses) - 1, 1))
        out[name] = round(sum(per_prompt) / len(per_prompt), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--via", choices=("server", "conversations"), default="server")
    parser.add_argument("--work", default=None, help="keep the run here (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="traffic-"))
    work.mkdir(parents=True, exist_ok=True)
    record, tuned = work / "recorded", work / "tuned"
    asked = questions(SUBJECTS, FRAMES)
    if args.via == "conversations":
        record = work / "questions.jsonl"
        lines = [json.dumps({"messages": [{"role": "user", "content": q}]}) for q in asked]
        record.write_text("\n".join(lines) + "\n")
    tic = time.perf_counter()
    if args.via == "server" and not (record / "replies.jsonl").exists():
        seconds = record_traffic(args, record, asked)
        print(f"served and recorded {len(asked)} questions in {seconds:.0f} s", flush=True)
    elif args.via == "conversations":
        cmd = [sys.executable, "-m", "dflash_mlx", "train", "data", "--from", str(record),
               "--work", str(work / "finetune"), "--max-tokens", str(args.max_tokens)]  # fmt: skip
        subprocess.run(cmd, check=True)
        seconds = time.perf_counter() - tic
        print(f"replied to {len(asked)} questions in {seconds:.0f} s", flush=True)
    if not (tuned / "config.json").exists():
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        tic = time.perf_counter()
        cmd = [sys.executable, "-m", "dflash_mlx", "train", "finetune", "--from", str(record),
               "--draft", str(SHIPPED), "--out", str(tuned), "--work", str(work / "finetune"),
               "--epochs", str(args.epochs)]  # fmt: skip
        subprocess.run(cmd, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(f"fine-tune: {time.perf_counter() - tic:.0f} s wall, {cpu:.0f} s CPU", flush=True)

    model, tokenizer = load(smollm2_model_dir())
    drafts = {"shipped": load_draft(str(SHIPPED)), "fine-tuned": load_draft(str(tuned))}
    held_out = [render(tokenizer, q, chat=True) for q in questions(HELD_OUT_SUBJECTS, FRAMES[:3])]
    english = [render(tokenizer, p["prompt"], chat=True) for p in build_prompts(48, 1000)][:8]
    result = {
        "french_held_out": taus(model, tokenizer, drafts, held_out, args.max_tokens),
        "english_held_out": taus(model, tokenizer, drafts, english, args.max_tokens),
    }
    print(json.dumps(result, indent=1))
    (work / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
