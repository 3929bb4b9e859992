"""Beam search as vLLM runs it: on top of the engine, one token per beam per step.

Each step every live beam is submitted as a request of its whole token sequence with
``max_tokens=1`` and ``logprobs=2 * beam_width``; the engine's prefix cache holds the
blocks the beams share (the prompt and their common prefixes), so a step computes only
each beam's last, partial block. The candidates of all beams of a prompt are ranked by
their length-penalised cumulative logprob and the best ``beam_width`` go on. A beam
ending in EOS (unless ``ignore_eos``) is set aside as completed. The drivers (the
offline ``LLM.beam_search`` and the server's ``use_beam_search``) only run the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.outputs import Logprob
from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included, as in vLLM), and per generated
    position the candidates the engine returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(generated_len: int, cum_logprob: float, length_penalty: float) -> float:
    """HF transformers' score: cum_logprob / generated_len ** length_penalty, the length
    counting the generated tokens (a final EOS included). vLLM divides by the whole
    sequence's length less EOS; the two rank equal-length beams alike (EOS ignored),
    and HF, the correctness reference here, decides the rest."""
    try:
        return cum_logprob / (max(generated_len, 1) ** length_penalty)
    except OverflowError:  # a huge penalty: the length term swamps the logprob
        return -0.0 if length_penalty > 0 else -math.inf


@dataclass
class BeamSearchInstance:
    """The beams of one prompt while the search runs."""

    prompt_len: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_token_ids: list[int]) -> BeamSearchInstance:
        return cls(len(prompt_token_ids), [BeamSearchSequence(list(prompt_token_ids), [])])


class BeamSearch:
    """Runs ``params`` over prompts; ``step`` hands back the engine's candidates."""

    def __init__(
        self,
        params: BeamSearchParams,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        max_logprobs: int,
    ) -> None:
        """Raises ValueError when a step would ask for more logprobs than the engine gives."""
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_model_len = max_model_len
        wanted = 2 * params.beam_width
        if max_logprobs != -1 and wanted > max_logprobs:
            raise ValueError(
                f"beam_width={params.beam_width} needs {wanted} logprobs per step, more than "
                f"the engine's max_logprobs={max_logprobs} (raise max_logprobs)"
            )

    def sampling_params(self) -> SamplingParams:
        """The one-token request each beam makes per step."""
        return SamplingParams(
            n=1,
            temperature=self.params.temperature,
            max_tokens=1,
            logprobs=2 * self.params.beam_width,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _score_key(self, prompt_len: int) -> Callable[[BeamSearchSequence], float]:
        penalty = self.params.length_penalty
        return lambda beam: get_beam_search_score(
            len(beam.tokens) - prompt_len, beam.cum_logprob, penalty
        )

    def live_beams(self, instances: Sequence[BeamSearchInstance]) -> list[BeamSearchSequence]:
        """The beams to extend this step, in instance order."""
        return [beam for instance in instances for beam in instance.beams]

    def advance(
        self,
        instances: Sequence[BeamSearchInstance],
        candidates: Sequence[dict[int, Logprob]],
    ) -> None:
        """Extends every live beam by its candidates (one dict per beam of live_beams, in
        order) and keeps the best beam_width per prompt; beams at EOS or at the model's
        length limit move to ``completed``."""
        position = 0
        for instance in instances:
            extended: list[BeamSearchSequence] = []
            for beam in instance.beams:
                row = candidates[position]
                position += 1
                for token_id, logprob in row.items():
                    extended.append(
                        BeamSearchSequence(
                            tokens=[*beam.tokens, token_id],
                            logprobs=[*beam.logprobs, row],
                            cum_logprob=beam.cum_logprob + logprob.logprob,
                        )
                    )
            extended.sort(key=self._score_key(instance.prompt_len), reverse=True)
            instance.beams = []
            for beam in extended:
                if len(instance.beams) == self.params.beam_width:
                    break
                if beam.tokens[-1] in self.eos_token_ids:
                    beam.finish_reason, beam.stop_reason = "stop", beam.tokens[-1]
                    instance.completed.append(beam)
                elif len(beam.tokens) >= self.max_model_len:
                    beam.finish_reason = "length"
                    instance.completed.append(beam)
                else:
                    instance.beams.append(beam)
        assert position == len(candidates), "one candidate dict per live beam"

    def finish(
        self, instance: BeamSearchInstance, decode: Callable[[list[int]], str]
    ) -> BeamSearchOutput:
        """The best beam_width beams, with their generated text."""
        for beam in instance.beams:
            beam.finish_reason = "length"
        ranked = sorted(
            [*instance.completed, *instance.beams],
            key=self._score_key(instance.prompt_len),
            reverse=True,
        )[: self.params.beam_width]
        for beam in ranked:
            generated = beam.tokens[instance.prompt_len :]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = decode(generated)
        return BeamSearchOutput(sequences=ranked)
