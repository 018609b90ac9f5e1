"""Slow tier: `edgespec chat` on the real default model (a base model) answers instead of babbling.

One conversation on piped stdin, greedy so it is deterministic; a `/stats` after each question
splits the output into replies and tells how many tokens each took."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 96
# (question, any of these must be in the reply); coding questions name what a correct answer writes
QUESTIONS = [  # one conversation, in this order: each answer is asked after the ones before it
    ("Write a Python function that reverses a string.", ("def ",)),
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("Write a Python function that checks if a number is even.", ("% 2",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What language is spoken in Brazil?", ("Portuguese",)),
    ("What is the opposite of hot?", ("cold", "Cold")),
    ("What color is the sky on a clear day?", ("blue", "Blue")),
]
STATS = re.compile(r"last reply: \[(\d+) tokens[^\n]*\n(?:session:[^\n]*\n)?(?:k over time[^\n]*|no drafts[^\n]*)\n")


def test_default_chat_answers_questions(cache_env):
    stdin = "".join(f"{q}\n/stats\n" for q, _ in QUESTIONS)
    proc = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--temperature", "0",
                           "--max-tokens", str(MAX_TOKENS)],
                          input=stdin, capture_output=True, text=True, timeout=1800, env=cache_env)
    assert proc.returncode == 0, proc.stderr
    assert "base model" in proc.stderr and "--chat-format" in proc.stderr  # the first-run note
    parts = STATS.split(proc.stdout)  # reply, token count, reply, token count, ..., trailing text
    assert len(parts) == 2 * len(QUESTIONS) + 1, proc.stdout
    for i, (question, expected) in enumerate(QUESTIONS):
        reply, n_tokens = parts[2 * i].strip(), int(parts[2 * i + 1])
        context = f"Q: {question}\nA: {reply!r} ({n_tokens} tokens)"
        assert reply, context
        assert n_tokens < MAX_TOKENS, "the reply did not end by itself: " + context
        assert question.lower().rstrip("?.") not in reply.lower(), "the reply repeats the question: " + context
        assert "Question:" not in reply and "Answer:" not in reply, context  # cut at the next speaker
        assert any(e in reply for e in expected), context
