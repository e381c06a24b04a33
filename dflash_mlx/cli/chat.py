"""`dflash-mlx chat`: a multi-turn chat in the terminal, like `mlx_lm.chat`.

The target cache, drafter cache and context features are kept across turns
(`make_prompt_cache`): each turn renders the whole conversation with the chat
template and only the tokens the caches do not hold yet are prefilled.

Ctrl-C stops the answer at the end of the current verify cycle, where the
caches are consistent; the partial answer stays in the conversation. A second
Ctrl-C interrupts at once, and the caches are then rebuilt on the next turn.
"""

from __future__ import annotations

import argparse
import copy
import os
import select
import signal
import sys
from collections.abc import Callable, Iterator

from ..chat_format import chat_prompt, encode_chat
from ..decode.prompt_cache import make_prompt_cache
from ..decode.settings import GenerationSettings
from ..generate import stream_generate
from ..models.distributed import Lockstep, world_group
from ..models.target import TargetAdapter
from ..options import (
    PrefillProgress,
    add_model_arguments,
    add_system_prompt_argument,
    add_template_config_argument,
    generation_settings,
    load_models,
)
from ..response import GenerationResponse, ReplyStats

HELP = """commands:
  /reset   start a new conversation (the system message is kept)
  /stats   totals for this conversation
  /help    this help
  /quit    exit (also /exit, or Ctrl-D)
Ctrl-C stops the current answer and keeps the conversation."""


class Chat:
    """A conversation: its messages, the caches holding them, and per-turn stats.

    Under `mlx.launch` rank 0 holds the conversation and sends each turn's
    prompt ids to the other ranks, which run `reply` with it in lockstep.
    """

    def __init__(
        self,
        model,
        tokenizer,
        draft,
        settings: GenerationSettings,
        system: str | None,
        reuse: bool,
        template_kwargs: dict | None = None,
        lockstep: Lockstep | None = None,
    ):
        self.model, self.tokenizer, self.draft = model, tokenizer, draft
        self.settings, self.system, self.reuse = settings, system, reuse
        self.template_kwargs = template_kwargs or {}
        self.lockstep = lockstep or Lockstep(None, 0, "chat")
        self.max_context = TargetAdapter(model).max_context
        self.cache = make_prompt_cache(model, draft, **settings.cache_options)
        self.progress = PrefillProgress()
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.fresh_cache = True  # made by the next reply, on every rank
        self.turns: list[ReplyStats] = []

    def reply(
        self,
        prompt: list[int],
        max_tokens: int,
        fresh_cache: bool,
        stop: Callable[[], bool] = lambda: False,
    ) -> tuple[int, Iterator[GenerationResponse]]:
        """The tokens to prefill and the responses to `prompt` (the whole conversation);
        what every rank runs for a turn."""
        if fresh_cache:
            self.cache = make_prompt_cache(self.model, self.draft, **self.settings.cache_options)
        new = len(prompt) - self.cache.reuse(prompt)
        settings = self.settings.but(max_tokens=max_tokens)
        responses = stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            prompt,
            settings=settings,
            prompt_cache=self.cache,
            prompt_progress_callback=self.progress if self.lockstep.leader else None,
        )
        return new, self.lockstep.steps(responses, stop)

    def follow(self) -> None:
        """Ranks but 0: run rank 0's turns until it ends the chat."""
        for turn in self.lockstep.units():
            for _ in self.reply(**turn)[1]:
                pass

    def ask(self, text: str) -> None:
        """Stream the answer to `text` to stdout, then its stats line."""
        self.messages.append({"role": "user", "content": text})
        text = chat_prompt(self.tokenizer, self.messages, **self.template_kwargs)
        prompt = encode_chat(self.tokenizer, text)
        room = self.max_context - len(prompt) if self.max_context else self.settings.max_tokens
        if room < 1:
            self.messages.pop()
            print(
                f"[the conversation is {len(prompt)} tokens, the model's context holds "
                f"{self.max_context}: /reset to start a new one]"
            )
            return
        turn = {
            "prompt": prompt,
            "max_tokens": min(self.settings.max_tokens, room),
            "fresh_cache": self.fresh_cache or not self.reuse,
        }
        self.fresh_cache = False
        stats = ReplyStats()
        stop = []

        def interrupt(*_) -> None:
            stop.append(True)
            signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = signal.signal(signal.SIGINT, interrupt)
        self.lockstep.send(turn)
        new, responses = self.reply(**turn, stop=lambda: bool(stop))
        try:
            for response in responses:
                stats.add(response)
                print(response.text, end="", flush=True)
        except KeyboardInterrupt:
            if self.lockstep.group is not None:
                raise  # the other ranks are mid-cycle: only ending every rank is safe
            stop.append(True)
            self.fresh_cache = True  # stopped mid-cycle
        finally:
            responses.close()
            signal.signal(signal.SIGINT, previous)
        self.messages.append({"role": "assistant", "content": stats.text})
        self.turns.append(stats)
        note = "interrupted; " if stop else ""
        print(f"\n[{note}{stats.summary()} ({new} new)]", flush=True)

    def totals(self) -> str:
        tokens = sum(t.tokens for t in self.turns)
        cycles = sum(t.cycles for t in self.turns)
        committed = sum(t.tokens - 1 for t in self.turns if t.tokens)
        accepted = sum(t.accepted for t in self.turns)
        return (
            f"[{len(self.turns)} turns, {len(self.messages)} messages, {tokens} tokens generated, "
            f"τ {committed / cycles if cycles else 0:.2f}, "
            f"{accepted} from accepted drafts, "
            f"{0 if self.fresh_cache else len(self.cache.tokens)} tokens cached]"
        )


def read_line(prompt: str) -> str:
    """`input(prompt)`, but a Ctrl-C that lands after the prompt is shown and before
    the read starts still raises KeyboardInterrupt instead of being held until Enter,
    and a pasted line longer than 4,095 bytes arrives whole.

    A terminal in canonical mode (the kernel's line editing) keeps 4,095 bytes of a
    line and drops the rest, and a paste typically arrives while we wait. So with
    `readline`, which reads in non-canonical mode, the wait is out of canonical mode
    too, and out of echo: readline shows what arrived, and draws the prompt again.
    """
    if not sys.stdin.isatty():
        return input(prompt)
    if not line_editing():
        wait_for_input(prompt)
        return input()
    import termios  # Unix only, as readline is

    fd = sys.stdin.fileno()
    cooked = termios.tcgetattr(fd)

    def uncook(off: int) -> None:
        """The terminal in mode `cooked` less local-mode flags `off`, a read taking what has
        arrived (VMIN 1)."""
        attrs = copy.deepcopy(cooked)
        attrs[3] &= ~off
        attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 1, 0
        termios.tcsetattr(fd, termios.TCSANOW, attrs)

    try:
        uncook(termios.ICANON | termios.ECHO)
        wait_for_input(prompt)
        uncook(termios.ICANON)  # readline echoes only if the terminal does
        print("\r", end="", flush=True)  # the prompt, drawn again by readline, goes over it
        return input(prompt)
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, cooked)


def line_editing() -> bool:
    """Whether `input` reads through `readline` (importing it is what makes it so), which
    it does where stdin and stdout are both terminals."""
    try:
        import readline  # noqa: F401
    except ImportError:  # a Python built without it
        return False
    return sys.stdout.isatty()


def wait_for_input(prompt: str) -> None:
    """Show `prompt` and wait until the terminal has input; KeyboardInterrupt for a Ctrl-C
    at any time during the wait.

    A signal only interrupts a read that is already waiting, so `input` alone loses a
    Ctrl-C that lands before its read starts. Here the signal also writes its number to
    a pipe (`signal.set_wakeup_fd`) and the wait is on the terminal and the pipe
    together: the number is there whenever the signal came. Only for a terminal: a
    pipe's lines may sit in `sys.stdin`'s buffer, out of `select`'s sight.
    """
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    previous_handler = signal.signal(signal.SIGINT, lambda *_: None)  # the pipe tells instead
    previous_fd = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    try:
        print(prompt, end="", flush=True)
        while True:
            ready, _, _ = select.select([sys.stdin, wake_read], [], [])
            if wake_read in ready and signal.SIGINT in os.read(wake_read, 64):
                raise KeyboardInterrupt
            if sys.stdin in ready:
                return
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        os.close(wake_read)
        os.close(wake_write)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, max_tokens=512)
    add_system_prompt_argument(parser)
    add_template_config_argument(parser)
    parser.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="prefill the whole conversation every turn (to measure what the cache saves)",
    )


def run(args: argparse.Namespace) -> None:
    model, tokenizer, draft = load_models(args)
    lockstep = Lockstep(world_group(), args.rank_timeout, "dflash-mlx chat")
    chat = Chat(
        model,
        tokenizer,
        draft,
        generation_settings(args, tokenizer),
        args.system,
        not args.no_prompt_cache,
        args.chat_template_config,
        lockstep,
    )
    if not lockstep.leader:
        chat.follow()
        return
    chat_prompt(tokenizer, [{"role": "user", "content": "check"}])  # fail or warn now, not later
    end = "/quit" if lockstep.group else "Ctrl-D"  # mlx.launch never passes on an end of input
    print(f"dflash-mlx chat: /help for commands, {end} to exit", flush=True)
    converse(chat)
    lockstep.send(None)  # the end: the other ranks exit too


def converse(chat: Chat) -> None:
    """The REPL: read lines until Ctrl-D or /quit, answering or running commands."""
    while True:
        try:
            line = read_line(">> ").strip()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /quit to exit)")
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            chat.reset()
            print("[new conversation]")
        elif line == "/stats":
            print(chat.totals())
        elif line == "/help":
            print(HELP)
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]}; /help lists them", file=sys.stderr)
        elif line:
            chat.ask(line)


if __name__ == "__main__":
    from . import run_as_module

    run_as_module("chat")
