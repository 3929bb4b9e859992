"""FusedMoE: routing rules against HF's routers, grouped execution against a per-expert
loop and HF's Mixtral block, expert weight loading (per expert, stacked, TP shards)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.benchmarks.moe import per_expert_loop
from kvserve.model_executor.layers import expert_parallel
from kvserve.model_executor.layers.expert_parallel import ExpertPlacement
from kvserve.model_executor.layers.fused_moe import FusedMoE, fused_experts, select_experts
from kvserve.transformers_utils.arch_families import MoEConfig

HIDDEN, INTER, EXPERTS = 32, 48, 8


def _layer(config: MoEConfig) -> tuple[FusedMoE, list[dict[str, torch.Tensor]]]:
    """A layer filled expert by expert from HF-layout tensors (returned too)."""
    torch.manual_seed(0)
    layer = FusedMoE(config, HIDDEN)
    experts = [
        {
            "w1": torch.randn(INTER, HIDDEN) * 0.2,
            "w3": torch.randn(INTER, HIDDEN) * 0.2,
            "w2": torch.randn(HIDDEN, INTER) * 0.2,
        }
        for _ in range(config.num_experts)
    ]
    for e, weights in enumerate(experts):
        for shard, tensor in weights.items():
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(param, tensor, shard, e)
    return layer, experts


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64])
def test_grouped_execution_equals_a_per_expert_loop_and_hf(num_tokens: int) -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=INTER)
    layer, _ = _layer(config)
    router = torch.randn(EXPERTS, HIDDEN)
    x = torch.randn(num_tokens, HIDDEN)
    got = layer.forward(x, F.linear(x, router))
    loop = per_expert_loop(x, layer.w13_weight, layer.w2_weight, router, config)
    torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)
    hf_config = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    hf_config._experts_implementation = "eager"
    hf = MixtralSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(router)
        hf.experts.gate_up_proj.copy_(layer.w13_weight)
        hf.experts.down_proj.copy_(layer.w2_weight)
        expected = hf(x.unsqueeze(0))[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_sigmoid_grouped_routing_matches_deepseek_v3() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(hf_config)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
    config = MoEConfig(
        num_experts=EXPERTS, top_k=3, intermediate_size=INTER, scoring_func="sigmoid",
        routed_scaling_factor=2.5, num_expert_group=4, topk_group=2, has_correction_bias=True,
    )  # fmt: skip
    x = torch.randn(50, HIDDEN)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(
        F.linear(x, router.weight), config, router.e_score_correction_bias
    )
    hf_order, order = hf_ids.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )


def test_softmax_group_limited_routing_matches_deepseek_v2() -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf_config = DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=4,
        topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(hf_config)
    torch.manual_seed(2)
    with torch.no_grad():
        router.weight.normal_()
    config = MoEConfig(
        num_experts=EXPERTS, top_k=2, intermediate_size=INTER, renormalize=False,
        routed_scaling_factor=1.5, num_expert_group=4, topk_group=2,
    )  # fmt: skip
    x = torch.randn(50, HIDDEN)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight), config)
    hf_order, order = hf_ids.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )


def test_stacked_experts_load_like_single_ones() -> None:
    config = MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=INTER)
    layer, experts = _layer(config)
    stacked = FusedMoE(config, HIDDEN)
    for shard in ("w1", "w3", "w2"):
        param = stacked.w2_weight if shard == "w2" else stacked.w13_weight
        stacked.weight_loader(param, torch.stack([e[shard] for e in experts]), shard)
    assert torch.equal(stacked.w13_weight, layer.w13_weight)
    assert torch.equal(stacked.w2_weight, layer.w2_weight)
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w2_weight, torch.zeros(HIDDEN + 1, INTER), "w2", 0)


def test_tensor_parallel_shards_sum_to_the_full_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of 2 ranks holds half of every expert's intermediate dim; the partial outputs
    (all-reduced in a TP group) add up to the unsharded result."""
    config = MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=INTER)
    full, experts = _layer(config)
    x = torch.randn(9, HIDDEN)
    logits = torch.randn(9, EXPERTS)
    partials = []
    for rank in range(2):
        monkeypatch.setattr(expert_parallel, "get_tp_rank_size", lambda rank=rank: (rank, 2))
        shard = FusedMoE(config, HIDDEN)
        assert shard.w13_weight.shape == (EXPERTS, INTER, HIDDEN)  # 2 * INTER / 2
        for e, weights in enumerate(experts):
            for name, tensor in weights.items():
                param = shard.w2_weight if name == "w2" else shard.w13_weight
                shard.weight_loader(param, tensor, name, e)
        partials.append(shard.forward(x, logits))
    torch.testing.assert_close(partials[0] + partials[1], full.forward(x, logits))


def test_fused_experts_weights_each_expert_output() -> None:
    """One token, one expert with weight 1: exactly that expert's gated MLP."""
    config = MoEConfig(num_experts=EXPERTS, top_k=1, intermediate_size=INTER)
    layer, experts = _layer(config)
    x = torch.randn(1, HIDDEN)
    out = fused_experts(x, layer.w13_weight, layer.w2_weight, torch.ones(1, 1), torch.tensor([[5]]))
    e = experts[5]
    expected = (F.silu(x @ e["w1"].T) * (x @ e["w3"].T)) @ e["w2"].T
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_expert_parallel_shares_sum_to_the_full_layer(num_tokens: int) -> None:
    """Each of 2 expert-parallel ranks holds 4 whole experts and adds only their terms;
    the partial outputs (summed over the EP group) add up to the full layer's."""
    config = MoEConfig(num_experts=EXPERTS, top_k=2, intermediate_size=INTER)
    full, _ = _layer(config)
    x = torch.randn(num_tokens, HIDDEN)
    weights, ids = select_experts(torch.randn(num_tokens, EXPERTS), config)
    partials = []
    for rank in range(2):
        placement = ExpertPlacement(EXPERTS, ep_rank=rank, ep_size=2)
        mine = slice(placement.first_local_expert, placement.first_local_expert + 4)
        partials.append(
            fused_experts(
                x,
                full.w13_weight[mine],
                full.w2_weight[mine],
                weights,
                ids,
                placement.first_local_expert,
                EXPERTS,
            )
        )
    expected = fused_experts(x, full.w13_weight, full.w2_weight, weights, ids)
    torch.testing.assert_close(partials[0] + partials[1], expected)


def test_expert_placement_splits_evenly_or_says_why() -> None:
    placement = ExpertPlacement(8, ep_rank=1, ep_size=4)
    assert (placement.first_local_expert, placement.num_local_experts) == (2, 2)
    assert [placement.local_index(e) for e in (1, 2, 3, 4)] == [None, 0, 1, None]
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertPlacement(6, ep_rank=0, ep_size=4)
