"""Decoding: sampling, speculative acceptance, draft-length policies and the decoding loop."""
from edgespec.decoding.acceptance import (
    accept_greedy,
    accept_sampled,
    invert_id_map,
    map_draft_ids,
    scatter_to_target,
)
from edgespec.decoding.policy import POLICIES, DraftPolicy, FixedK, make_policy
from edgespec.decoding.sampling import SamplingParams, probabilities, sample
from edgespec.decoding.speculative import DEFAULT_K, SpeculativeDecoder, StepResult

__all__ = [
    "DEFAULT_K",
    "POLICIES",
    "DraftPolicy",
    "FixedK",
    "SamplingParams",
    "SpeculativeDecoder",
    "StepResult",
    "accept_greedy",
    "accept_sampled",
    "invert_id_map",
    "make_policy",
    "map_draft_ids",
    "probabilities",
    "sample",
    "scatter_to_target",
]
