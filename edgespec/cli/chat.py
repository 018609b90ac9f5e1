"""`edgespec chat [BUNDLE]`: a streaming REPL on a ChatSession.

Interactive on a terminal; reads one message per line when stdin is piped.
Ctrl-C stops the current reply and keeps the conversation; Ctrl-D or /exit quits.
A base model chats through a plain-text transcript (--chat-format; models/chat_formats.py)."""
from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError, EdgespecError
from ..models.chat_formats import CHAT_FORMAT_CHOICES, CHAT_SAMPLING, TRANSCRIPTS
from ..models.templates import ChatTemplateError
from .common import (
    Terminated,
    add_engine_args,
    add_sampling_args,
    cli_entry,
    open_engine,
    print_memory_plan,
    sampling_kwargs,
    setup_logging,
    validate_sampling,
)
from .generate import _format_stats

__all__ = ["main", "build_parser", "k_over_time"]

HELP = """commands:
  /reset   forget the conversation (keeps the system prompt)
  /stats   speed, acceptance and draft lengths of the last reply and the session
  /exit    quit (also Ctrl-D); Ctrl-C stops a reply"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgespec chat", description="Chat with a bundle.")
    p.add_argument("bundle", nargs="?", default=None, help="bundle or .gguf file (default: the embedded Gemma 3 270M)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--chat-format", default="auto", metavar="FORMAT",
                   help=f"how messages are shown to the model: {', '.join(CHAT_FORMAT_CHOICES)}. auto (default): "
                        "the model's own chat template; for a base model the plain-text transcript of its family "
                        f"(transcripts: {'; '.join(t.description for t in TRANSCRIPTS.values())})")
    # sampled like llama.cpp's and LM Studio's chat defaults (docs/chat-formats.md); --temperature 0 is greedy
    add_sampling_args(p, max_tokens=512, temperature=CHAT_SAMPLING.temperature, top_p=CHAT_SAMPLING.top_p,
                      top_k=CHAT_SAMPLING.top_k, min_p=CHAT_SAMPLING.min_p)
    add_engine_args(p)
    return p


def k_over_time(ks: list[int], sources: list[str], max_runs: int = 24) -> str:
    """Draft length per step as runs, e.g. "0×12 2 4L×3": 12 plain steps, one 2-token model draft,
    three 4-token prompt-lookup drafts (L)."""
    labels = [f"{k}L" if src.startswith("ngram") else str(k) for k, src in zip(ks, sources)]
    runs: list[list] = []
    for label in labels:
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    text = " ".join(label if n == 1 else f"{label}×{n}" for label, n in runs[:max_runs])
    return text + (f" ... (+{len(runs) - max_runs} runs)" if len(runs) > max_runs else "")


def _session_stats(session) -> str:
    turns = session.turn_stats
    if not turns:
        return "no replies yet"
    last = _format_stats(turns[-1])
    drafted, accepted = sum(t.drafted for t in turns), sum(t.accepted for t in turns)
    last_turn = turns[-1]
    ks = k_over_time(last_turn.k_history, last_turn.source_history)
    k_line = (f"k over time (last reply; L = prompt lookup): {ks}" if last_turn.drafted
              else "no drafts in the last reply")
    total = f"session: {len(turns)} replies, {sum(t.new_tokens for t in turns)} tokens"
    decode_s = sum(max(t.elapsed_s - t.first_token_s, 0.0) for t in turns)
    if decode_s > 0:  # every reply's tokens after its first step over the time after it
        total += f", {sum(t.decode_tokens for t in turns) / decode_s:.1f} tok/s"
    if drafted:
        total += f", acceptance {accepted / drafted:.0%}"
    return f"last reply: {last}\n{total}\n{k_line}"


def _reply(session, text: str, sampling: dict, out) -> None:
    seen = len(session.notices)
    stream = session.send(text, **sampling)
    try:
        for r in stream:
            out.write(r.text)
            out.flush()
    except Terminated:  # SIGTERM: the process ends, after the caches are rewound below
        raise
    except KeyboardInterrupt:
        out.write(" [stopped]")
    finally:
        stream.close()  # rewinds the caches and records the (partial) reply
        out.write("\n")
        out.flush()
        for note in session.notices[seen:]:
            print(f"[{note}]", file=sys.stderr)


def _read(interactive: bool) -> str | None:
    try:
        return input(">>> ") if interactive else sys.stdin.readline() or None
    except EOFError:
        return None


def _tolerant_stdio() -> None:
    """Bytes that are not valid in the terminal's encoding (a Latin-1 byte in a UTF-8 pipe) become
    U+FFFD instead of ending the chat and losing the conversation; the same for replies written
    to a terminal that cannot show a character."""
    for stream in (sys.stdin, sys.stdout):
        reconfigure = getattr(stream, "reconfigure", None)  # absent when tests swap in a StringIO
        if reconfigure is not None:
            reconfigure(errors="replace")


def validate_chat_format(value: str) -> None:
    """Fail on an unknown --chat-format before any model is loaded."""
    if value not in CHAT_FORMAT_CHOICES:
        raise ConfigError(f"unknown --chat-format {value!r} (choose from: {', '.join(CHAT_FORMAT_CHOICES)})")


def format_note(session, base_model: bool) -> str | None:
    """The first-run note: what the model is shown and how to change it (None: nothing to say)."""
    fmt = session.format
    others = ", ".join(c for c in CHAT_FORMAT_CHOICES if c not in ("auto", fmt.name))
    if fmt.transcript is not None:
        who = "this is a base model (no chat template of its own)" if base_model else "chat format chosen"
        return (f"note: {who}; chatting through {fmt.describe()}. It continues text rather than follows "
                f"instructions. Change it with --chat-format ({others}).")
    if base_model:
        return ("note: this is a base model; the chat template was not trained into it and it may babble "
                f"(--chat-format auto uses a plain-text transcript; others: {others}).")
    return None


def repl(engine, args: argparse.Namespace, interactive: bool, out=sys.stdout) -> None:
    session = engine.chat(system=args.system, chat_format=args.chat_format)
    session.check_room(args.max_tokens)  # a context that no message fits: one line, before the chat starts
    sampling = sampling_kwargs(args)
    refused = engine.opened.inexact_refusal
    if refused is not None:  # the first line: the user asked for speculative decoding and gets plain
        print(f"edgespec chat: plain decoding, drafting is off: {refused}", file=sys.stderr)
    note = format_note(session, engine.bundle.manifest.base_model)
    if note:
        print(note, file=sys.stderr)
    if interactive:
        print("edgespec chat - /help for commands, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = _read(interactive)
        except Terminated:
            raise
        except KeyboardInterrupt:  # at the prompt: a new line, not an exit
            print("", file=sys.stderr)
            continue
        if line is None:
            return
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/help":
            print(HELP, file=out)
        elif line == "/reset":
            session.reset()
            print("[conversation cleared]", file=out)
        elif line == "/stats":
            print(_session_stats(session), file=out)
        else:
            try:
                _reply(session, line, sampling, out)
            except ChatTemplateError:  # invalid or unsafe whatever is said: no turn can succeed, exit 2
                raise
            except EdgespecError as e:  # report and keep the conversation
                print(f"edgespec: error: {e}", file=sys.stderr)


@cli_entry
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    validate_sampling(args)
    validate_chat_format(args.chat_format)
    _tolerant_stdio()
    with open_engine(args) as engine:
        print_memory_plan(engine, args.verbose)
        repl(engine, args, interactive=sys.stdin.isatty())
    return 0
