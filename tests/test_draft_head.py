"""A trained draft head on tiny models: the target's own data, a short training that lowers the
held-out loss, its ONNX graph computing what torch computed (onnxruntime and OpenVINO), and the
`head` drafter: greedy output identical to plain decoding, sampling exact (chi-square)."""
from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.decoding import SamplingParams, probabilities  # noqa: E402
from edgespec.decoding.head_drafter import draft_index  # noqa: E402
from edgespec.decoding.speculative import SpeculativeDecoder  # noqa: E402
from edgespec.errors import ConfigError  # noqa: E402
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime  # noqa: E402
from edgespec.runtimes.onnxruntime.split import OnnxFeatureHead, open_shared_pair  # noqa: E402
from edgespec.training.distill import DistillConfig, distill_bundle  # noqa: E402
from edgespec.training.draft_head import build_onnx, reference  # noqa: E402
from edgespec.training.draft_head_data import collect, head_matrix  # noqa: E402
from edgespec.training.draft_head_train import TorchHead, train_head  # noqa: E402
from tests.test_sampling_engine import MIN_EXPECTED, N_RUNS, P_MIN, chi_square_p  # noqa: E402
from tests.tiny import PROMPTS  # noqa: E402
from tests.zoo import AGREEING  # noqa: E402


def onnx_files(path):
    m = load_bundle(path).manifest
    return path / m.target.formats["onnx"].file, path / m.draft.formats["onnx"].file


@pytest.fixture(scope="module")
def distilled(zoo, tmp_path_factory):
    """The tiny untied Gemma 3 bundle (int8 self-draft) with a head trained for 5 seconds."""
    path = tmp_path_factory.mktemp("head") / "b"
    shutil.copytree(zoo.bundle("gemma3", AGREEING), path)
    distill_bundle(DistillConfig(path, train_minutes=5 / 60, gen_tokens=8, progress=False))
    return path


@pytest.fixture(scope="module")
def pair(distilled):
    b = load_bundle(distilled)
    target, draft = onnx_files(distilled)
    t, d = open_shared_pair(target, draft, draft_head=b.file(b.manifest.draft_head.file))
    yield t, d
    t.close()
    d.close()


def tokenizer(path):
    from edgespec.tokenizer import Tokenizer

    m = load_bundle(path).manifest
    return Tokenizer(path / m.tokenizer.file, m.tokenizer)


@pytest.mark.parametrize("speculative", [False, True], ids=["one-by-one", "speculative"])
def test_data_are_the_targets_rows_and_greedy_tokens(zoo, speculative):
    path = zoo.bundle("gemma3", AGREEING)
    target, draft = onnx_files(path)
    seqs = [tokenizer(path).encode(p) for p in PROMPTS[:2]]
    want = []
    with OnnxRuntime(target) as fused:
        for s in seqs:
            fused.reset()
            want.append(np.argmax(fused.forward(s, n_logits=len(s)), axis=-1))
    t, d = open_shared_pair(target, draft)
    with t, d:
        data = collect(t, seqs, gen_tokens=5, draft=d if speculative else None, id_map=load_bundle(path).id_map())
        w = head_matrix(d.head, d.head.hidden_size)
        logits = np.array(d.head(data.hidden[:3]))
    n = [len(s) for s in seqs]
    assert data.hidden.shape == (len(data), d.head.hidden_size) and data.hidden.dtype == np.float32
    assert len(data) <= sum(n) + 10 and sorted(set(data.segment.tolist())) == [0, 1]
    for i, s in enumerate(seqs):
        rows = np.flatnonzero(data.segment == i)
        assert data.tokens[rows[:n[i]]].tolist() == s  # the prompt, then its greedy continuation
        assert data.greedy[rows[:n[i]]].tolist() == want[i].tolist()
        assert data.tokens[rows[n[i]:]].tolist() == data.greedy[rows[n[i] - 1:-1]].tolist()
        # where the drafter drafts: the rows whose next token the target generated
        assert data.decode[rows].tolist() == [j >= n[i] - 1 for j in range(len(rows))]
    # the draft's head is the matrix read from it: its logits of a row are that row times W
    assert w.shape == (d.vocab_size, d.head.hidden_size)
    np.testing.assert_allclose(data.hidden[:3] @ w.T, logits, rtol=0.05,
                               atol=0.05 * np.abs(data.hidden[:3] @ w.T).max())


def test_a_short_training_lowers_the_held_out_loss(zoo):
    path = zoo.bundle("gemma3", AGREEING)
    target, draft = onnx_files(path)
    seqs = [tokenizer(path).encode(p) for p in PROMPTS] * 2
    t, d = open_shared_pair(target, draft)
    with t, d:
        data = collect(t, seqs, gen_tokens=12)
        w = head_matrix(d.head, d.head.hidden_size)
    result = train_head(data, w, draft_index(load_bundle(path).id_map(), t.vocab_size), seconds=5, progress=False)
    assert result.steps > 1 and result.samples > 0 and result.held_out > 0
    assert result.loss < result.first_loss
    assert 0.0 <= result.agreement <= 1.0 and result.peak_rss_mb > 0


def test_the_exported_head_computes_what_torch_does(tmp_path):
    rng = np.random.default_rng(0)
    k, h = 40, 16
    head = TorchHead(rng.standard_normal((k + 1, h)).astype(np.float32), 24, np.ones(h), seed=1)
    for p in head.parameters():  # away from the initial values (a zero down-projection, unit gains)
        p.data += 0.1 * torch.randn_like(p)
    hidden = rng.standard_normal((5, h)).astype(np.float32)
    tokens = np.array([0, 3, k, 7, 7])
    with torch.no_grad():
        want = head(torch.from_numpy(hidden), torch.from_numpy(tokens)).numpy()
    weights = head.weights()
    np.testing.assert_allclose(reference(weights, hidden, tokens), want, rtol=1e-4, atol=1e-4)
    import onnx

    onnx.save(build_onnx(weights), tmp_path / "head.onnx")
    ort = OnnxFeatureHead(tmp_path / "head.onnx")
    np.testing.assert_allclose(ort(hidden, tokens), want, rtol=1e-4, atol=1e-4)
    assert ort.hidden_size == h
    pytest.importorskip("openvino")
    from edgespec.runtimes.openvino.split import OpenVinoFeatureHead

    ov = OpenVinoFeatureHead(tmp_path / "head.onnx")
    np.testing.assert_allclose(ov(hidden, tokens), want, rtol=1e-4, atol=1e-4)


def test_the_manifest_records_the_head(distilled):
    entry = load_bundle(distilled).manifest.draft_head
    assert entry is not None and (distilled / entry.file).is_file()
    assert entry.k == load_bundle(distilled).manifest.draft.vocab_size and entry.feature_layer == "final_norm"
    assert entry.training_tokens > 0 and 0 < entry.train_seconds < 60 and 0.0 <= entry.held_out_agreement <= 1.0


def test_head_drafter_greedy_output_is_plain_greedy(distilled, pair):
    t, d = pair
    tok = tokenizer(distilled)
    drafted = 0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        plain = [x for s in SpeculativeDecoder(t).stream(list(ids), SamplingParams(), 24) for x in s.tokens]
        t.reset()
        steps = list(SpeculativeDecoder(t, d, id_map=load_bundle(distilled).id_map(), drafter="head")
                     .stream(list(ids), SamplingParams(), 24))
        t.reset()
        assert [x for s in steps for x in s.tokens] == plain
        assert all(s.source in ("head", "") for s in steps)
        drafted += sum(s.drafted for s in steps)
    assert drafted > 0


def test_head_drafter_sampling_follows_the_target(distilled, pair):
    t, d = pair
    ids = tokenizer(distilled).encode(PROMPTS[1])
    params = SamplingParams(temperature=1.0)
    p = probabilities(OnnxRuntime(onnx_files(distilled)[0]).forward(ids, n_logits=1)[-1], params)
    dec = SpeculativeDecoder(t, d, id_map=load_bundle(distilled).id_map(), drafter="head")
    firsts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_RUNS):
        step = list(dec.stream(list(ids), SamplingParams(temperature=1.0, seed=seed), 2))[0]
        firsts[step.tokens[0]] += 1
        drafted += step.drafted
        accepted += step.accepted
    assert drafted == N_RUNS
    assert 0.05 * N_RUNS < accepted < 0.95 * N_RUNS, accepted  # drafts were kept and replaced
    assert int((N_RUNS * p >= MIN_EXPECTED).sum()) >= 10
    assert chi_square_p(firsts, p) > P_MIN


def test_head_drafter_needs_a_trained_head(zoo):
    target, draft = onnx_files(zoo.bundle("gemma3", AGREEING))
    t, d = open_shared_pair(target, draft)
    with t, d, pytest.raises(ConfigError, match="edgespec distill"):
        SpeculativeDecoder(t, d, drafter="head")
    with OnnxRuntime(target) as t, OnnxRuntime(draft) as d, pytest.raises(ConfigError, match="target's body"):
        SpeculativeDecoder(t, d, drafter="head")  # a draft with its own body (as llama.cpp's always is)


def test_the_engine_opens_a_bundles_head_for_the_head_drafter(distilled):
    from edgespec.engine.engine import load

    for backend in ("onnxruntime",):  # the tiny bundle holds ONNX only
        with load(distilled, backend=backend, draft_body="shared", drafter="head", k=3, policy="fixed") as e:
            out = list(e.stream(PROMPTS[0], max_tokens=16))
            ids = e.tokenizer.encode(PROMPTS[0])
            plain = [x for s in e.variant(plain=True).stream(list(ids), SamplingParams(), 16) for x in s.tokens]
            assert e.tokenizer.decode(plain) == "".join(r.text for r in out)
            stats = out[-1].stats
            assert stats.drafted > 0 and set(stats.source_history) <= {"head", ""}, stats.source_history
