"""RejectionSampler on small synthetic logits: greedy verification is exact, random
verification reproduces the target distribution (and a broken rule would not), and
penalties see the accepted drafts as output."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.sample import Sampler, SamplingBatch
from kvserve.sample.rejection_sampler import RejectionSampler
from kvserve.sample.spec_decode_metadata import SpecDecodeMetadata
from kvserve.sampling_params import SamplingParams

V = 8
CPU = torch.device("cpu")


def make_batch(
    params: list[SamplingParams], outputs: list[list[int]] | None = None
) -> SamplingBatch:
    batch = SamplingBatch(max_num_reqs=len(params), vocab_size=V, device=CPU)
    for row, p in enumerate(params):
        out = outputs[row] if outputs else []
        gen = torch.Generator().manual_seed(1000 + row) if p.seed is not None else None
        batch.add_request(row, p, [0, 1], out, gen)
    return batch


def verify(
    batch: SamplingBatch,
    drafts: list[list[int]],
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """Rows are laid out as the runner does: row i's len(drafts[i]) + 1 logits in order."""
    num_logits = np.array([len(d) + 1 for d in drafts])
    last = np.cumsum(num_logits) - 1
    spec = SpecDecodeMetadata.make(drafts, last, CPU)
    rows = np.arange(len(drafts))
    out = RejectionSampler()(
        spec,
        draft_probs,
        logits,
        rows,
        lambda r: batch.make_sampling_metadata(batch.num_reqs, torch.from_numpy(r)),
    )
    return out.sampled_token_ids


def test_greedy_keeps_the_matching_prefix_then_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4 + 1 + 5, V)  # rows with 3, 0 and 4 drafts
    target = logits.argmax(-1).tolist()
    drafts = [
        [target[0], target[1], (target[2] + 1) % V],  # two accepted, the third rejected
        [],  # no drafts: just the next token
        target[5:9],  # all accepted: the bonus token follows
    ]
    batch = make_batch([SamplingParams(temperature=0.0)] * 3)
    assert verify(batch, drafts, logits) == [
        [target[0], target[1], target[2]],
        [target[4]],
        target[5:10],
    ]
    # The same with a processor active (the per-position path): same answer.
    bias = SamplingParams(temperature=0.0, logit_bias={0: 0.0})
    assert verify(make_batch([bias] * 3), drafts, logits) == verify(batch, drafts, logits)


def test_greedy_with_a_penalty_sees_accepted_drafts_as_output() -> None:
    # Position 1's repetition penalty must count draft 0 as output, as plain decoding would.
    logits = torch.zeros(2, V)
    logits[0, 3] = 5.0
    logits[1, 3] = 1.0  # argmax 3 only if 3 is not penalised
    logits[1, 4] = 0.9
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    batch = make_batch([params])
    out = verify(batch, [[3]], logits)
    # Plain decoding: token 3, then with output [3] the penalty makes 4 the argmax.
    assert out == [[3, 4]]
    assert batch.output_token_ids[0] == []  # the live list is restored


def _empirical(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).float() / len(tokens)


def test_random_verification_preserves_the_target_distribution() -> None:
    torch.manual_seed(3)
    row_logits = torch.randn(V) * 1.5
    n = 6000
    params = SamplingParams(temperature=0.8, top_k=6)
    scaled = row_logits / 0.8
    kth = scaled.topk(6).values[-1]
    p = torch.where(scaled >= kth, scaled, torch.tensor(float("-inf"))).softmax(-1)
    draft = int(p.argsort()[-2])  # a likely but not the likeliest token

    batch = make_batch([params] * n)
    first = [row[0] for row in verify(batch, [[draft]] * n, row_logits.repeat(2 * n, 1))]
    # Without speculation: the plain Sampler on the same rows.
    plain_batch = make_batch([params] * n)
    plain = Sampler()(row_logits.repeat(n, 1), plain_batch.make_sampling_metadata(n))
    plain_tokens = plain.sampled_token_ids.tolist()
    # A draft model's q (not one-hot): drafts drawn from q, accepted with min(1, p/q),
    # recovered from max(p - q, 0).
    q = torch.randn(V).softmax(-1)
    q_drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(5))
    with_q = [
        row[0]
        for row in verify(
            make_batch([params] * n),
            [[int(t)] for t in q_drafts],
            row_logits.repeat(2 * n, 1),
            q.repeat(n, 1),
        )
    ]

    bound = 0.03  # TV of 6000 samples over <= 8 outcomes stays well below this
    for tokens in (first, plain_tokens, with_q):
        tv = 0.5 * float((_empirical(tokens) - p).abs().sum())
        assert tv < bound, tv
    # A broken rule (accept the draft always, or resample from p on rejection) is far off.
    always_accept = torch.zeros(V)
    always_accept[draft] = 1.0
    resample_from_p = p * (1 - p[draft])
    resample_from_p[draft] += p[draft]
    for broken in (always_accept, resample_from_p):
        assert 0.5 * float((broken - p).abs().sum()) > 3 * bound


def test_seeded_rows_repeat_their_tokens() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=1.0, seed=7)
    runs = [verify(make_batch([params]), [[1, 2]], logits) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_a_seeded_row_emits_the_plain_sampler_tokens_whatever_its_drafts() -> None:
    # The target distribution at each of 6 positions, whatever came before (synthetic).
    torch.manual_seed(3)
    position_logits = torch.randn(6, V)
    params = [SamplingParams(temperature=1.0, seed=7)]

    plain_batch = make_batch(params)
    plain = [verify(plain_batch, [[]], position_logits[j : j + 1])[0][0] for j in range(6)]

    def emitted_with(drafts_per_step: list[list[int]]) -> list[int]:
        batch, out = make_batch(params), []
        for draft in drafts_per_step:
            start = len(out)
            logits = position_logits[start : start + len(draft) + 1]
            out += verify(batch, [draft], logits)[0]
        return out[:6]

    wrong = [(t + 1) % V for t in plain]
    # Two drafts accepted and the third rejected; a rejection at once; all accepted (the
    # bonus token follows); no drafts at all: the same six tokens every time.
    assert emitted_with([[plain[0], plain[1], wrong[2]], [wrong[3]], [plain[4]]]) == plain
    assert emitted_with([[wrong[0]], [plain[1], plain[2], plain[3], plain[4]]]) == plain
    assert emitted_with([[]] * 6) == plain
