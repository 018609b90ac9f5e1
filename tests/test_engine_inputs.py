"""The one check of caller text (engine/inputs.py), as the API and the command line use it."""
from __future__ import annotations

import pytest

from edgespec.engine.inputs import check_text
from edgespec.errors import ConfigError


def test_text_from_argv_names_the_byte_and_api_text_the_surrogate():
    assert check_text("héllo", "the prompt", argv=True) == "héllo"
    # Python keeps argv's byte 0xe9 (Latin-1 'é') as the lone surrogate U+DCE9 (surrogateescape)
    with pytest.raises(ConfigError, match=r"^the prompt is not UTF-8 text \(byte 0xe9 at offset 3\)$"):
        check_text("caf\udce9", "the prompt", argv=True)
    with pytest.raises(ConfigError, match=r"^the prompt is not UTF-8 text \(a lone surrogate U\+D800 at offset 0\)$"):
        check_text("\ud800", "the prompt", argv=True)
    with pytest.raises(ConfigError, match=r"^the message is not valid Unicode text \(a lone surrogate at offset 3\)$"):
        check_text("hi \udcff", "the message")
    with pytest.raises(ConfigError, match="the prompt must be text"):
        check_text(5, "the prompt")
