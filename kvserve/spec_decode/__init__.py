"""Speculative decoding: proposers that draft tokens for the target model to verify
(the RejectionSampler in kvserve/sample/ keeps the accepted prefix)."""

from __future__ import annotations

from kvserve.spec_decode.proposer import NoOpProposer, Proposer, ProposerInputs, create_proposer

__all__ = ["NoOpProposer", "Proposer", "ProposerInputs", "create_proposer"]
