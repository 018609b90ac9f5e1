"""Write the tokenizer into a bundle as tokenizer.json plus the facts the runtime needs."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from ..bundle import TokenizerInfo
from ..errors import ExportError
from ..models.families import Family
from .gguf.tokenizer import compact_merges

__all__ = ["export_tokenizer"]

logger = logging.getLogger(__name__)
_PROBE = "Hello world, this is edgespec."


def _stop_ids(model, tokenizer, family: Family) -> list[int]:
    ids: set[int] = set()
    for eos in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in family.stop_tokens if t in vocab)
    return sorted(ids)


def _chat_template(tokenizer, family: Family) -> tuple[str | None, str]:
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # named templates: the default one is for chat
        tmpl = tmpl.get("default") or next(iter(tmpl.values()), None)
    if tmpl:
        return tmpl, "model"
    if family.fallback_chat_template:
        return family.fallback_chat_template, "family"
    return None, "none"


def export_tokenizer(source, family: Family, out_dir: Path, rel: str = "tokenizer.json") -> TokenizerInfo:
    """Save `source.tokenizer` as `out_dir/rel` and describe how to use it."""
    from tokenizers import Tokenizer

    tok = source.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        src = Path(tmp) / "tokenizer.json"
        if not src.is_file():
            raise ExportError("the tokenizer has no fast form (tokenizer.json); edgespec needs one")
        # merges as "left right" strings: the same tokenizer, parsed at half the peak memory
        (out_dir / rel).write_text(compact_merges(src.read_text(encoding="utf-8")), encoding="utf-8")
    raw = Tokenizer.from_file(str(out_dir / rel)).encode(_PROBE).ids
    ref = tok(_PROBE).input_ids
    bos = tok.bos_token_id
    if ref == raw:
        add_bos = False
    elif bos is not None and ref == [bos] + raw:
        add_bos = True
    else:
        raise ExportError("tokenizer.json does not reproduce the model's tokenizer; cannot export it")
    template, origin = _chat_template(tok, family)
    return TokenizerInfo(
        file=rel,
        bos_token_id=bos,
        add_bos=add_bos,
        stop_token_ids=_stop_ids(source.model, tok, family),
        chat_template=template,
        chat_template_source=origin,
    )
