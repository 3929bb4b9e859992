"""Optional engine features: speculative decoding, structured outputs, LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.config.json_args import dataclass_from_json
from kvserve.config.model import ModelConfig

SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys): a proposer drafts
    ``num_speculative_tokens`` tokens per step and the target verifies them in one forward.

    ``method``: "ngram" (prompt lookup, no model), "suffix" (suffix decoding: no model, the
    request's own tokens and recent requests' outputs) or "draft_model" (a second model with
    the target's tokenizer). A draft model left unset (or naming the target) is the target's own
    file, usually run with a lossy, faster ``quantization`` such as "gguf_int8".
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    # ngram: the longest and shortest suffix of the tokens so far looked up earlier on.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # suffix: the longest suffix matched and the deepest path kept (vLLM's default 24); how
    # many finished requests' outputs the shared tree keeps (0: none; vLLM keeps 10000 in
    # C++, a Python tree costs more memory per token); drafts of at most factor x match
    # length; a draft stops where its cumulative continuation frequency falls below the prob.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # The draft model's weights (same values as ModelConfig.quantization).
    quantization: str | None = None
    draft_model_config: ModelConfig | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.method is None:
            # vLLM accepts model="ngram" for prompt lookup; any other model is a draft model.
            self.method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.method == "suffix":
            self._check_suffix()
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be a positive int, "
                f"got {self.num_speculative_tokens!r}"
            )
        if self.method == "ngram":
            self.model = None
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(5, self.prompt_lookup_min or 0)
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = min(2, self.prompt_lookup_max)
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )

    def _check_suffix(self) -> None:
        self.model = None
        depth = self.suffix_decoding_max_tree_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_tree_depth must be a positive int, "
                f"got {depth!r}"
            )
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(
                "speculative_config.suffix_decoding_max_cached_requests must be an int >= 0, "
                f"got {cached!r}"
            )
        factor = self.suffix_decoding_max_spec_factor
        if not isinstance(factor, int | float) or factor <= 0:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_spec_factor must be > 0, got {factor!r}"
            )
        prob = self.suffix_decoding_min_token_prob
        if not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError(
                f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}"
            )
        # As vLLM: drafts as deep as the tree unless set.
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = depth

    def resolve_draft_model(self, target: ModelConfig) -> None:
        """Builds the draft's ModelConfig (draft_model only); the target's own file when
        ``model`` is unset, and always the target's tokenizer and context length."""
        if self.method != "draft_model":
            return
        same_file = self.model is None or self.model == target.model
        draft = ModelConfig(
            model=target.model if same_file else self.model,
            max_model_len=None,
            quantization=self.quantization,
        )
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model {draft.model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {target.vocab_size}: they must match"
            )
        assert target.max_model_len is not None and draft.max_model_len is not None
        if draft.max_model_len < target.max_model_len:
            raise ValueError(
                f"speculative_config.model {draft.model!r} holds {draft.max_model_len} "
                f"positions, fewer than the target's max_model_len {target.max_model_len}"
            )
        self.draft_model_config = draft

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past the verified tokens a step may write: a draft model runs ahead by
        the drafts it proposes; ngram writes nothing."""
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_cli(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """A config from itself, a dict, or the JSON text of `--speculative-config`."""
        if isinstance(value, SpeculativeConfig):
            return value
        return dataclass_from_json(cls, value, "--speculative-config")


@dataclass
class StructuredOutputsConfig:
    """Grammar-constrained decoding (vLLM's StructuredOutputsConfig)."""

    # xgrammar, guidance (llguidance), or auto: xgrammar unless only llguidance runs a spec.
    backend: str = "auto"


@dataclass
class LoRAConfig:
    """vLLM's LoRA engine arguments: adapters resident at once, and their largest rank."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
