"""The candidate generator on its own: its place relative to transformers' contract, and its tree expansion."""

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from transformers_jakiro.drafting import JakiroCandidateGenerator


def test_not_a_transformers_candidate_generator():
    """It returns a DraftTree, which the CandidateGenerator contract (linear candidate ids and logits) cannot
    express, so it does not claim that contract; the docstring says so."""
    assert not issubclass(JakiroCandidateGenerator, CandidateGenerator)
    assert "Not a transformers `CandidateGenerator`" in JakiroCandidateGenerator.__doc__
