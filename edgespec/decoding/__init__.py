"""Decoding: sampling, speculative acceptance, drafters, draft-length policies and the decoding loop."""
from edgespec.decoding.acceptance import accept_coupled, accept_greedy, map_draft_ids
from edgespec.decoding.drafters import DRAFTERS, BothDrafter, Draft, Drafter, ModelDrafter, NgramDrafter, build_drafter
from edgespec.decoding.draws import Draws, Noise
from edgespec.decoding.policy import (
    DEFAULT_POLICY,
    POLICIES,
    CostAwareK,
    DraftPolicy,
    FixedK,
    HeuristicK,
    make_policy,
)
from edgespec.decoding.recycling import RecyclingDrafter
from edgespec.decoding.sampling import LazyDists, SamplingParams, check_max_tokens, distribution, probabilities, sample
from edgespec.decoding.speculative import DEFAULT_K, SpeculativeDecoder, StepResult
from edgespec.decoding.stats import GenerationStats
from edgespec.decoding.token_dist import Candidates, DenseDist, TokenDist, point_mass

__all__ = [
    "DEFAULT_K",
    "DEFAULT_POLICY",
    "DRAFTERS",
    "DenseDist",
    "Draws",
    "POLICIES",
    "BothDrafter",
    "Candidates",
    "CostAwareK",
    "Draft",
    "DraftPolicy",
    "Drafter",
    "FixedK",
    "GenerationStats",
    "HeuristicK",
    "LazyDists",
    "ModelDrafter",
    "Noise",
    "NgramDrafter",
    "RecyclingDrafter",
    "SamplingParams",
    "SpeculativeDecoder",
    "StepResult",
    "TokenDist",
    "accept_coupled",
    "accept_greedy",
    "build_drafter",
    "check_max_tokens",
    "distribution",
    "make_policy",
    "map_draft_ids",
    "point_mass",
    "probabilities",
    "sample",
]
