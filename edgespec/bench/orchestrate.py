"""One `edgespec bench` run as a library call: check the outputs, load the engine, open the
llama.cpp peer, measure, and return the JSON document (schema.py). `cli/bench.py` parses flags,
calls `run_benchmark` and prints; a desktop app or a script can call it the same way.

    doc = run_benchmark(BenchRequest(bundle="my.bundle", bench=BenchConfig(repeat=2)))
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..cpus import usable_cpu_count, usable_cpu_ids
from ..engine.config import EngineConfig
from ..errors import ConfigError
from ..runtimes.onnxruntime.pool import pool_state
from .measure import PEER, BenchConfig, is_peer

__all__ = ["BenchRequest", "check_request", "run_benchmark", "save_results"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchRequest:
    """What to measure and where the results go. The engine measures only where drafting is exact
    unless `engine` says otherwise: bench checks that drafting's output equals plain decoding's."""

    bundle: str | None = None  # None: the default bundle
    engine: EngineConfig = field(default_factory=EngineConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    prompts: str = "all"  # a suite name, several joined by commas, or a .jsonl file
    json: str | None = None
    report: str | None = None
    label: str | None = None
    peer_gguf: str | None = None  # None: the GGUF the bundle's target came from, if any
    peer: bool = True
    # which peers run: "llama.cpp" (llama-cpp-python, in this process), "llama-server" (llama.cpp's
    # own server, plain) and "llama-server+TYPE" (with its speculative type TYPE)
    peers: tuple[str, ...] = (PEER,)
    llama_server: str | None = None  # the llama-server binary or folder; None: deploy.build.locate()
    peer_draft_gguf: str | None = None  # llama-server+draft-simple's draft; None: the bundle's standalone draft

    def __post_init__(self) -> None:
        if not self.peer and self.peer_gguf:
            raise ConfigError("--peer-gguf and --no-peer contradict each other; give one")
        for name in self.peers:
            if not is_peer(name):
                raise ConfigError(f"--peers: unknown peer {name!r} (llama.cpp, llama-server, llama-server+TYPE)")
        if len(set(self.peers)) != len(self.peers):
            raise ConfigError(f"--peers names one twice: {', '.join(self.peers)}")


def check_request(req: BenchRequest) -> None:
    """Every output and input checked before minutes of measuring, not after."""
    if req.json:
        from .schema import check_json_path

        check_json_path(req.json)
    if req.peer_gguf:
        from .peer import check_gguf

        check_gguf(req.peer_gguf)
    if req.report:
        from .report import check_report_dir, require_matplotlib

        require_matplotlib()
        check_report_dir(req.report)


def _threads(req: BenchRequest, engine) -> int:
    """The threads the engine and its peers run on: the engine's (the fast cores of a big.LITTLE
    CPU: the process is pinned to them), the request's, or every usable CPU."""
    return engine.plan.threads or req.engine.threads or usable_cpu_count()


def _open_peer(req: BenchRequest, engine, notify: Callable[[str], None]):
    """The llama.cpp peer for this bundle (or `peer_gguf`), or None: no GGUF to run it on, or
    llama-cpp-python missing (then `notify` says how to get it, and the bench runs without it)."""
    from .peer import LlamaCppPeer, VulkanPeer, find_peer_gguf, missing_reason, on_gpu, vulkan_missing_reason

    source = find_peer_gguf(engine.bundle, req.peer_gguf)
    if source is None:
        return None
    gpu = on_gpu(engine.target)  # the peer runs where the target runs, or the column compares devices
    reason = missing_reason() or (vulkan_missing_reason() if gpu else None)
    if reason is not None:
        notify(f"no llama.cpp column: {reason}")
        return None
    threads = _threads(req, engine)
    peer = (VulkanPeer if gpu else LlamaCppPeer)(source, threads=threads, n_ctx=engine.context_limit or 4096,
                                                 vocab_size=engine.target.vocab_size)
    d = peer.describe()
    notify(f"peer llama.cpp ({d['library']} {d['version']}{', on ' + d['gpu'] if gpu else ''}) on "
           f"{source.path.name}, {threads} threads")
    return peer


def _thermal(engine):
    """The clocks and temperatures to read around each run (thermal.py): of the cores the engine runs on."""
    from .thermal import Thermal

    cores = engine.plan.cores
    cpus = cores.cpus if cores is not None else usable_cpu_ids()
    return Thermal(cpus)


def _heat(runs, thermal, cfg: BenchConfig, notify: Callable[[str], None]) -> dict:
    """The runs' thermal record (thermal.summarise_heat), its warnings said at once."""
    from .thermal import summarise_heat

    heat = summarise_heat(runs, thermal.source(), cfg.cooldown_s)
    for warning in heat["warnings"]:
        notify(f"WARNING: {warning}")
    return heat
def _server_draft(req: BenchRequest, engine):
    """llama-server+draft-simple's draft GGUF: --peer-draft-gguf, else the bundle's standalone draft."""
    from ..deploy.command import bundle_models
    from ..errors import DeployError
    from .peer import check_gguf

    if req.peer_draft_gguf:
        return check_gguf(req.peer_draft_gguf)
    try:
        _, draft, same = bundle_models(engine.bundle)
    except DeployError:
        draft, same = None, False
    if draft is None or same:
        raise ConfigError("llama-server+draft-simple needs a draft GGUF cheaper than the target: --peer-draft-gguf "
                          "FILE (or a bundle exported with --format gguf and --draft-layers N)")
    return draft


def _open_server_peers(req: BenchRequest, engine, notify: Callable[[str], None], stack) -> list:
    """llama.cpp's own server, once per llama-server peer asked for (server_peer.py), each closed by `stack`."""
    from ..deploy import SpecSettings, locate
    from .peer import find_peer_gguf, on_gpu
    from .server_peer import LlamaServerPeer, parse_peer

    names = [n for n in req.peers if n != PEER]
    if not names or not req.peer:
        return []
    source = find_peer_gguf(engine.bundle, req.peer_gguf)
    if source is None or on_gpu(engine.target):
        notify("no llama-server column: " + ("no GGUF to run it on" if source is None else
                                              "the target runs on a GPU, llama-server on the CPU"))
        return []
    build = locate(req.llama_server)
    threads = _threads(req, engine)
    out = []
    for name in names:
        kind = parse_peer(name)
        draft = _server_draft(req, engine) if kind == "draft-simple" else None
        peer = LlamaServerPeer(source, threads=threads, n_ctx=engine.context_limit or 4096,
                               vocab_size=engine.target.vocab_size, spec=SpecSettings(type=kind), draft=draft,
                               build=build, stop_at_eos=req.bench.stop_at_eos)
        stack.callback(peer.close)
        notify(f"peer {name}: {build.server.name} ({build.source}) {' '.join(peer.describe()['flags'])}")
        out.append(peer)
    return out


def describe_sampling(params) -> str:
    """'greedy', or the sampler's settings in one phrase."""
    if params.greedy:
        return "greedy"
    parts = [f"temperature {params.temperature:g}", f"top-p {params.top_p:g}", f"top-k {params.top_k}"]
    if params.min_p:
        parts.append(f"min-p {params.min_p:g}")
    return "sampled (" + ", ".join(parts) + ")"


def _announce(engine, machine: dict, prompts, configs: list[str], cfg: BenchConfig, notify) -> dict | None:
    """Say what runs, and measure the target's c(B) (costs.py), which the document records."""
    from .costs import verify_costs

    classes = list(dict.fromkeys(p.cls for p in prompts))
    notify(f"{engine.bundle.path.name} on {machine['cpu']} ({machine['arch']}, {machine['cores_usable']} cores), "
           f"{engine.backend}; drafter {engine.drafter_name}, policy {engine.policy_name}, k={engine.k}; "
           f"{describe_sampling(cfg.sampling)}; "
           f"{len(prompts)} prompts in {len(classes)} classes × {cfg.repeat} repeats × {len(configs)} "
           f"configurations, {cfg.max_tokens} tokens each")
    if engine.exactness is not None:
        notify(engine.exactness.describe())
    costs = verify_costs(engine.target)
    if costs is not None:
        notify("c(B) " + ", ".join(f"{b}: {c:.2f}" for b, c in costs["c"].items())
               + f" over {costs['one_token_ms']:.1f} ms")
    return costs


def _roofline(engine, costs: dict | None, threads: int, notify) -> dict | None:
    """The engine's roofline (roofline.py): the c(B) figures, a drafted token timed on the same
    prefix, the weights each forward reads and the machine's read bandwidth measured now."""
    from .costs import verify_costs
    from .roofline import bandwidths, describe, roofline

    if costs is None:
        return None
    if engine.draft is not None:
        drafted = verify_costs(engine.target, (1,), draft=engine.draft)
        costs = {**costs, "draft_ms": None if drafted is None else drafted.get("draft_ms")}
    draft = engine.draft.streamed() if engine.draft is not None else None
    doc = roofline(engine.target.streamed(), draft, costs, bandwidths(threads))
    if doc is not None:
        notify("memory read bandwidth " + ", ".join(f"{t} thread{'s' * (t != '1')} {v:.1f} GB/s"
                                                    for t, v in doc["bandwidth_gb_s"].items()))
        for line in describe(doc):
            notify("roofline: " + line)
    return doc


def run_benchmark(req: BenchRequest, *, notify: Callable[[str], None] | None = None, live: bool = True) -> dict:
    """Measure `req` and return its document; `notify` receives one-line progress notes, `live`
    shows the running table (live.py). Outputs are checked first (check_request), not written."""
    import psutil

    from ..engine import engine as api
    from .document import build_document
    from .live import LiveTable
    from .machine import machine_info
    from .measure import build_decoders, run_bench
    from .runner import PeakRSS
    from .suites import load_prompts

    notify = notify or (lambda line: logger.info("%s", line))
    prompts = load_prompts(req.prompts)
    check_request(req)
    cfg = req.bench
    machine = machine_info()
    proc = psutil.Process()
    rss = PeakRSS()
    rss.start()
    try:
        rss_before = proc.memory_info().rss
        with api.load(req.bundle, req.engine) as engine, contextlib.ExitStack() as stack:
            rss_after = proc.memory_info().rss
            configs = list(build_decoders(engine, cfg.k_sweep))  # fails early if nothing drafts
            peer = _open_peer(req, engine, notify) if req.peer and PEER in req.peers else None
            if peer is not None:
                stack.callback(peer.close)
                configs.append(peer.name)
            servers = _open_server_peers(req, engine, notify, stack)
            configs += [s.name for s in servers]
            costs = _announce(engine, machine, prompts, configs, cfg, notify)
            roof = _roofline(engine, costs, _threads(req, engine), notify)
            table = LiveTable(configs, list(dict.fromkeys(p.cls for p in prompts)), repeat=cfg.repeat,
                              greedy=cfg.sampling.greedy) if live else None
            started, t0 = datetime.now(timezone.utc), time.perf_counter()
            thermal = _thermal(engine)
            try:
                runs = run_bench(engine, prompts, cfg, on_run=table.update if table else None, rss=rss, peer=peer,
                                 peers=servers, thermal=thermal)
            finally:
                if table is not None:
                    table.close()
            heat = _heat(runs, thermal, cfg, notify)
            ran = [peer] if peer is not None else []
            return build_document(
                engine, runs, cfg, prompts_spec=req.prompts, configs=configs, machine=machine, label=req.label,
                prompts=prompts, backend=_backend_record(engine),
                memory={"rss_before_load": rss_before, "rss_after_load": rss_after, "engine": engine.memory()},
                memory_budget=engine.config.memory_budget, started=started, duration_s=time.perf_counter() - t0,
                peer=peer.describe() if peer is not None else None, verify_costs=costs, roofline=roof,
                peers={p.name: p.describe() for p in ran + servers}, thermal=heat)
    finally:
        rss.stop()


def _backend_record(engine) -> dict:
    """The JSON's `backend`: where the target and the draft ran, on how many threads and cores."""
    c = engine.config
    return {"name": engine.backend, "device": c.device, "draft_backend": engine.draft_backend,
            "draft_device": c.draft_device or (c.device if engine.draft_backend else None),
            "threads": engine.plan.threads,
            # the cores run on, and why (edgespec/engine/cores.py)
            "cores": engine.plan.cores.to_dict() if engine.plan.cores is not None else None,
            # whether onnxruntime's sessions shared the process-wide pool (runtimes/onnxruntime/pool.py)
            "onnxruntime_pool": pool_state()}


def save_results(doc: dict, path: str) -> str:
    """Write the results; if that fails after all (the folder went away), keep them in a temporary
    file and say where, so a long run is never lost."""
    import tempfile

    from .schema import save

    try:
        return str(save(doc, path))
    except ConfigError as e:
        fd, spare = tempfile.mkstemp(prefix="edgespec-bench-", suffix=".json")
        os.close(fd)
        save(doc, spare)
        raise ConfigError(f"{e}; the results are in {spare}") from None
