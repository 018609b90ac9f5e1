"""VocabTrim heads and layer-cut drafts: pure selection functions and exact decoding on tiny models."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import SamplingParams, probabilities
from edgespec.engine.engine import load
from edgespec.errors import ConfigError
from edgespec.exporters.draft_shape import select_layers
from edgespec.exporters.export import ExportConfig, export_bundle
from edgespec.exporters.vocabtrim import always_kept_ids, choose_vocab, coverage, read_prompt_file, token_counts
from edgespec.models.families import FAMILIES
from tests.tiny import make_model, make_tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_choose_vocab_keeps_specials_and_most_frequent():
    counts = np.array([0, 50, 3, 0, 40, 7, 1, 0, 9, 2])
    keep = choose_vocab(counts, 5, always={0, 3})
    assert keep.tolist() == [0, 1, 3, 4, 8]  # specials 0, 3 + top three by count
    assert np.all(np.diff(keep) > 0)
    assert coverage(counts, keep) == pytest.approx((50 + 40 + 9) / counts.sum())


def test_choose_vocab_ties_are_reproducible():
    counts = np.ones(20, dtype=np.int64)
    assert choose_vocab(counts, 4, set()).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("k,msg", [(11, "larger than the vocabulary"), (2, "smaller than the 3 special")])
def test_choose_vocab_bad_k(k, msg):
    with pytest.raises(ConfigError, match=msg):
        choose_vocab(np.arange(10), k, always={0, 1, 2})


def test_token_counts():
    assert token_counts([[1, 1, 2], [2, 3]], 5).tolist() == [0, 2, 2, 1, 0]


def test_always_kept_ids_skips_reserved_placeholders():
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<unused0>", "<unused1>", "<tool>"]})
    keep = always_kept_ids(tok, FAMILIES["gemma3_text"], template_ids=[42])
    vocab = tok.get_vocab()
    assert vocab["<tool>"] in keep and vocab["<s>"] in keep and vocab["<end_of_turn>"] in keep and 42 in keep
    assert vocab["<unused0>"] not in keep and vocab["<unused1>"] not in keep


def test_select_layers():
    assert select_layers(18, 18) == tuple(range(18))
    assert select_layers(18, 9)[0] == 0 and select_layers(18, 9)[-1] == 17 and len(select_layers(18, 9)) == 9
    assert select_layers(4, (3, 0)) == (0, 3)
    for bad in (0, 19, (18,), (), True, "3", (1, True)):
        with pytest.raises(ConfigError, match="--draft-layers"):
            select_layers(18, bad)


def test_read_prompt_file(tmp_path):
    f = tmp_path / "cal.txt"
    f.write_text('plain prompt\n\n{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "json text"}\n')
    assert read_prompt_file(f) == [{"kind": "text", "text": "plain prompt"},
                                   {"kind": "messages", "messages": [{"role": "user", "content": "hi"}]},
                                   {"kind": "text", "text": "json text"}]
    with pytest.raises(ConfigError, match="not found"):
        read_prompt_file(tmp_path / "missing.txt")


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    """A 4-layer tiny Qwen2 with a chat template; draft: 3 layers, VocabTrim K=96, int8."""
    root = tmp_path_factory.mktemp("trim")
    src = make_model("qwen2", root / "src", layers=4, chat_template=CHATML)
    cal = root / "cal.txt"
    cal.write_text("the cat and the dog\nhello world code\n")
    out = export_bundle(ExportConfig(output=root / "bundle", target=src, draft_vocab=96, draft_layers=3,
                                     draft_precision="int8", calibration=cal))
    return out


def test_trimmed_bundle_manifest_and_id_map(trimmed):
    m = json.loads((trimmed / "edgespec.json").read_text())["draft"]
    assert m["vocab_size"] == 96 and m["layers"] == [0, 2, 3] and m["n_layers"] == 3
    info = m["vocab_info"]
    assert info["k"] == 96 and 0 < info["coverage"] <= 1 and info["calibration"] == "built-in + cal.txt"
    id_map = np.load(trimmed / m["id_map"])
    assert id_map.shape == (96,) and np.all(np.diff(id_map) > 0)
    tok = json.loads((trimmed / "tokenizer.json").read_text())
    vocab = json.loads((trimmed / "edgespec.json").read_text())["target"]["vocab_size"]
    # every special / chat token the model can emit survives the trim (Qwen2's tokenizer adds
    # <|endoftext|> past this tiny model's vocabulary)
    specials = {t["id"] for t in tok["added_tokens"] if t["special"] and t["id"] < vocab}
    assert len(specials) == 7 and specials <= set(id_map.tolist())
    # round trip: the draft's logits index i means target id id_map[i]
    with load(trimmed) as engine:
        assert engine.draft.vocab_size == 96
        assert engine.decoder.id_map.tolist() == id_map.tolist()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_trimmed_layer_cut_draft_is_exact(trimmed, k):
    with load(trimmed, k=k) as spec, load(trimmed, use_draft=False) as plain:
        for prompt in ("the cat and", "hello world code python"):
            a = spec.generate(prompt, max_tokens=32)
            b = plain.generate(prompt, max_tokens=32)
            assert a == b
        assert spec.last_stats.drafted > 0


def test_chat_with_trimmed_draft_is_exact(trimmed):
    with load(trimmed, k=3) as spec, load(trimmed, use_draft=False) as plain:
        replies = []
        for engine in (spec, plain):
            chat = engine.chat()
            replies.append(["".join(r.text for r in chat.send(m, max_tokens=16)) for m in ("hi there", "the cat")])
        assert replies[0] == replies[1]


def test_sampling_with_a_trimmed_draft_keeps_the_target_distribution(trimmed):
    """First sampled token with a trimmed draft ~ the target's softmax (chi-square)."""
    with load(trimmed, k=3) as engine:
        prompt = engine.tokenizer.encode("the cat and")
        engine.target.reset()
        p = probabilities(engine.target.forward(prompt, n_logits=1)[-1], SamplingParams(temperature=1.0))
        engine.target.reset()
        n = 1500
        firsts = []
        for seed in range(n):
            tokens = list(prompt)
            for _ in engine.stream_ids(tokens, SamplingParams(temperature=1.0, seed=seed), 2):
                pass
            firsts.append(tokens[len(prompt)])
        assert engine.last_stats.drafted > 0
    observed = np.bincount(firsts, minlength=len(p)).astype(float)
    expected = p * n
    big = expected >= 5  # merge rare outcomes into one bin
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue > 1e-3


def test_bad_draft_vocab(tmp_path):
    src = make_model("llama", tmp_path / "src")
    with pytest.raises(ConfigError, match="not smaller than the vocabulary"):
        export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft_vocab=10**6))
    with pytest.raises(ConfigError, match="smaller than the"):
        export_bundle(ExportConfig(output=tmp_path / "b", target=src, draft_vocab=2))
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match="drop --draft none"):
        ExportConfig(output=tmp_path / "b", target=src, draft=None, draft_vocab=64)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_layer_cut_graph_matches_transformers_without_those_layers(tmp_path, family):
    """A layer-cut draft computes exactly the source model with the other layers removed."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
    from edgespec.exporters.spec import spec_from_hf
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    model = AutoModelForCausalLM.from_pretrained(make_model(family, tmp_path / "src", layers=4)).eval()
    spec = spec_from_hf(model)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    keep = (0, 1, 3)
    onnx.save(build_decoder(spec, weights, GraphOptions(layers=keep, tie_head=False)), tmp_path / "cut.onnx")
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits[0].numpy()
    with OnnxRuntime(tmp_path / "cut.onnx") as rt:
        got = rt.forward(ids[0].tolist(), n_logits=30)
    np.testing.assert_allclose(got, ref, atol=1e-4)


class _IdsTokenizer:
    """Text prompts of space-separated token ids."""

    def __call__(self, text, add_special_tokens=True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[int(t) for t in text.split()])


def test_calibrate_runtime_counts_what_the_runtime_generates():
    """The torch-free calibration: one prompt at a time on a runtime, reset between prompts,
    sampled (seeded), stopping at stop ids, which are not counted."""
    from edgespec.exporters.vocabtrim import calibrate_runtime
    from tests.toy import ToyRuntime

    prompts = [{"kind": "text", "text": " ".join(map(str, p))} for p in ([1, 2, 3], [4, 5], [7])]
    rt = ToyRuntime(vocab=50)
    cal = calibrate_runtime(rt, _IdsTokenizer(), prompts, "test", max_new_tokens=20)
    assert cal.n_tokens == 60 and cal.counts.shape == (50,) and cal.source == "test"
    assert rt.n_past == 1 + 20  # the last prompt alone: the runtime was reset before it
    again = calibrate_runtime(ToyRuntime(vocab=50), _IdsTokenizer(), prompts, "test", max_new_tokens=20)
    np.testing.assert_array_equal(again.counts, cal.counts)
    stop = int(np.argmax(cal.counts))
    stopped = calibrate_runtime(ToyRuntime(vocab=50), _IdsTokenizer(), prompts, "test", max_new_tokens=20,
                                stop_ids=[stop])
    assert stopped.counts[stop] == 0 and stopped.n_tokens < cal.n_tokens
