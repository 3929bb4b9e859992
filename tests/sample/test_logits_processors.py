"""Penalties and logits processors (built-in and custom) through the Sampler."""

from __future__ import annotations

import pytest
import torch

from kvserve.sample import BatchUpdate, LogitsProcessor, Sampler, SamplingBatch
from kvserve.sample.ops.penalties import apply_all_penalties
from kvserve.sampling_params import SamplingParams

V = 16
CPU = torch.device("cpu")
NEG_INF = float("-inf")


def greedy(
    params: SamplingParams,
    logits: torch.Tensor,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    eos: int | None = None,
) -> int:
    batch = SamplingBatch(max_num_reqs=4, vocab_size=V, device=CPU)
    batch.add_request(0, params, prompt or [0], output if output is not None else [], None, eos)
    return int(
        Sampler()(logits[None].clone(), batch.make_sampling_metadata(1)).sampled_token_ids[0]
    )


def test_penalties_numerically() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0]])
    prompt = torch.tensor([[0, 1, 6, 6]])  # padded with vocab size 6
    output = [[2, 3, 2]]

    def run(pres: float, freq: float, rep: float) -> torch.Tensor:
        return apply_all_penalties(
            logits.clone(),
            prompt,
            output,
            torch.tensor([pres]),
            torch.tensor([freq]),
            torch.tensor([rep]),
        )

    # Repetition: prompt and output tokens; positive divided, negative multiplied.
    torch.testing.assert_close(run(0, 0, 2.0), torch.tensor([[1.0, -2.0, 1.5, -4.0, 0.5, 1.0]]))
    # Frequency: count * penalty, output tokens only (token 0/1 are prompt only).
    torch.testing.assert_close(run(0, 0.5, 1.0), torch.tensor([[2.0, -1.0, 2.0, -2.5, 0.5, 1.0]]))
    # Presence: once per distinct output token.
    torch.testing.assert_close(run(0.5, 0, 1.0), torch.tensor([[2.0, -1.0, 2.5, -2.5, 0.5, 1.0]]))


def test_penalties_through_sampler_change_greedy_choice() -> None:
    logits = torch.zeros(V)
    logits[3], logits[4] = 2.0, 1.5
    assert greedy(SamplingParams(temperature=0.0), logits) == 3
    # Token 3 in the prompt only: repetition penalizes it, presence/frequency do not.
    assert greedy(SamplingParams(temperature=0.0, repetition_penalty=2.0), logits, [], [3]) == 4
    assert greedy(SamplingParams(temperature=0.0, presence_penalty=1.0), logits, [], [3]) == 3
    assert greedy(SamplingParams(temperature=0.0, frequency_penalty=0.3), logits, [3], [0]) == 3
    assert greedy(SamplingParams(temperature=0.0, frequency_penalty=0.3), logits, [3, 3], [0]) == 4
    assert greedy(SamplingParams(temperature=0.0, presence_penalty=1.0), logits, [3], [0]) == 4


def test_logit_bias_and_allowed_token_ids() -> None:
    torch.manual_seed(0)
    logits = torch.randn(V)
    worst = int(logits.argmin())
    assert greedy(SamplingParams(temperature=0.0, logit_bias={worst: 100.0}), logits) == worst
    allowed = [1, 5, 9]
    best_allowed = allowed[int(logits[allowed].argmax())]
    assert (
        greedy(SamplingParams(temperature=0.0, allowed_token_ids=allowed), logits) == best_allowed
    )
    batch = SamplingBatch(max_num_reqs=8, vocab_size=V, device=CPU)
    for row in range(8):
        batch.add_request(row, SamplingParams(allowed_token_ids=allowed), [0], [], None)
    seen: set[int] = set()
    for _ in range(30):
        out = Sampler()(torch.zeros(8, V), batch.make_sampling_metadata(8))
        seen |= set(out.sampled_token_ids.tolist())
    assert seen == set(allowed)


def test_bad_words_single_and_multi_token() -> None:
    logits = torch.zeros(V)
    logits[7], logits[4], logits[2] = 3.0, 2.0, 1.0
    single = SamplingParams(temperature=0.0)
    single._bad_words_token_ids = [[7]]
    assert greedy(single, logits) == 4
    multi = SamplingParams(temperature=0.0)
    multi._bad_words_token_ids = [[5, 6, 7], [4]]
    assert greedy(multi, logits, [1, 5]) == 7  # [5, 6] not yet output
    assert greedy(multi, logits, [5, 6]) == 2  # 7 completes the bad word; 4 is banned too
    assert greedy(multi, logits, [6, 5, 6, 1]) == 7


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(V)
    logits[2], logits[9], logits[4] = 3.0, 2.5, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    batch = SamplingBatch(max_num_reqs=4, vocab_size=V, device=CPU)
    output: list[int] = []
    batch.add_request(0, params, [0], output, None, eos_token_id=2)
    got = []
    for _ in range(5):
        tok = int(
            Sampler()(logits[None].clone(), batch.make_sampling_metadata(1)).sampled_token_ids[0]
        )
        got.append(tok)
        output.append(tok)
    assert got == [4, 4, 4, 2, 2]
    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert greedy(ignore, logits, eos=2) == 2  # eos not blocked when ignored
    assert params.all_stop_token_ids == [9]  # the caller's params are not modified


class ForcePromptEndProcessor(LogitsProcessor):
    """Test processor: rows whose prompt ends with token 0 must emit the prompt's first token."""

    def __init__(self, max_num_reqs: int, device: torch.device, is_pin_memory: bool) -> None:
        self.forced: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row, _, prompt, _ in batch_update.added:
            if prompt[-1] == 0:
                self.forced[row] = prompt[0]
            else:
                self.forced.pop(row, None)
        for row in batch_update.removed:
            self.forced.pop(row, None)
        for a, b, _ in batch_update.moved:  # SWAP or UNIDIRECTIONAL alike for a dict
            va, vb = self.forced.pop(a, None), self.forced.pop(b, None)
            if va is not None:
                self.forced[b] = va
            if vb is not None:
                self.forced[a] = vb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, tok in self.forced.items():
            keep = logits[row, tok].clone()
            logits[row] = NEG_INF
            logits[row, tok] = keep
        return logits


def test_custom_processor_is_applied_and_follows_moves_and_partial_rows() -> None:
    torch.manual_seed(1)
    batch = SamplingBatch(4, V, CPU, custom_logitsprocs=[ForcePromptEndProcessor])
    batch.add_request(0, SamplingParams(temperature=0.0), [3, 1], [], None)
    batch.add_request(1, SamplingParams(temperature=0.0), [11, 0], [], None)
    batch.add_request(2, SamplingParams(temperature=1.0), [13, 0], [], None)
    logits = torch.randn(3, V)
    out = Sampler()(logits.clone(), batch.make_sampling_metadata(3)).sampled_token_ids
    assert out[0] == logits[0].argmax() and out[1] == 11 and out[2] == 13
    batch.remove_request(0)
    batch.move_request(2, 0)
    # Only row 0 (the moved request) samples: the processor still sees it at batch row 0.
    out = Sampler()(torch.randn(1, V), batch.make_sampling_metadata(2, torch.tensor([0])))
    assert out.sampled_token_ids.tolist() == [13]
    out = Sampler()(torch.randn(1, V), batch.make_sampling_metadata(2, torch.tensor([1])))
    assert out.sampled_token_ids.tolist() == [11]


def test_processors_added_to_an_empty_batch_run_after_the_built_ins() -> None:
    batch = SamplingBatch(4, V, CPU)
    batch.add_logits_processors([ForcePromptEndProcessor])
    assert isinstance(batch.logitsprocs.non_argmax_invariant[-1], ForcePromptEndProcessor)
    batch.add_request(0, SamplingParams(temperature=0.0), [11, 0], [], None)
    out = Sampler()(torch.randn(1, V), batch.make_sampling_metadata(1)).sampled_token_ids
    assert out.tolist() == [11]
    # Rows already hold state the new processor never saw: refused.
    with pytest.raises(RuntimeError, match="empty batch"):
        batch.add_logits_processors([ForcePromptEndProcessor])
