"""Tiny random-weight HF models and an in-process tokenizer, for offline tests: the models are
edgespec's own (edgespec/exporters/tiny.py, which dev/ uses too); the prompts and the chat template
the tests give them are here."""
from __future__ import annotations

from edgespec.exporters.tiny import (  # noqa: F401  (the tests import them from here)
    CORPUS,
    LLAMA3_ROPE,
    VOCAB,
    WORDS,
    make_config,
    make_model,
    make_tokenizer,
)

# A ChatML chat template (Qwen style) for sources that should carry one of their own.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Longer than Gemma's sliding window (16) so the windowed layers matter from the first token;
# the tiny models continue them with varied text rather than a short loop.
LONG_PROMPT = "hello world code python function return value list print import class def data model one two three"
PROMPTS = (LONG_PROMPT, "if new water road snow cat dog cat to sun world and if with")
