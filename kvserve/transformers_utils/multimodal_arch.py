"""What a multimodal checkpoint adds to its text model, read from config.json: a Gemma 3
VLM's vision tower and image tokens, or Whisper's encoder (an encoder-decoder model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiModalArch:
    """What a vision-language checkpoint adds to its text model (Gemma 3 VLMs).

    ``vision_config``: the vision tower's HF config dict; ``bidirectional_items``: image
    tokens attend to each other both ways, so an image is computed in one step;
    ``max_tokens_per_item``: the longest placeholder range an image can take (Pan-and-Scan
    crops included), which sizes the encoder cache."""

    vision_config: dict[str, Any]
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bidirectional_items: bool
    max_tokens_per_item: int
    # An encoder-decoder model (Whisper): the item is the encoder's input, its output is
    # kept as cross-attention K/V instead of being placed among the decoder's tokens;
    # ``max_tokens_per_item`` is then the encoder output's length and ``vision_config``
    # the model's HF config (the encoder's numbers).
    encoder_decoder: bool = False
    # Token ids the model never emits (HF's suppress_tokens, every step) and never emits
    # first (begin_suppress_tokens): Whisper's generation config; HF's generate applies them.
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()


VLM_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
ENCODER_DECODER_ARCHITECTURES = ("WhisperForConditionalGeneration",)


def _token_ids(field: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"invalid Whisper config: {field} must be a list of token ids")
    return tuple(value)


def whisper_multimodal(
    cfg: dict[str, Any], generation: dict[str, Any]
) -> tuple[MultiModalArch, dict[str, Any]]:
    """Whisper's encoder side, and its config in the names ArchConfig reads (the
    decoder's numbers: ``max_target_positions`` is the decoder's context).
    ``generation``: generation_config.json, where the suppressed tokens live (older
    checkpoints keep them in config.json)."""
    try:
        heads = int(cfg["decoder_attention_heads"])
        decoder = {
            "hidden_size": int(cfg["d_model"]),
            "intermediate_size": int(cfg["decoder_ffn_dim"]),
            "num_hidden_layers": int(cfg["decoder_layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": int(cfg["max_target_positions"]),
            "layer_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        }
        encoder_len = int(cfg["max_source_positions"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"invalid Whisper config: {e!r}") from e
    multimodal = MultiModalArch(
        vision_config=dict(cfg),
        mm_tokens_per_image=encoder_len,
        image_token_id=-1,  # no placeholder tokens: the decoder never sees the audio's
        boi_token_id=-1,
        eoi_token_id=-1,
        bidirectional_items=False,
        max_tokens_per_item=encoder_len,
        encoder_decoder=True,
        suppress_tokens=_token_ids(
            "suppress_tokens", generation.get("suppress_tokens", cfg.get("suppress_tokens"))
        ),
        begin_suppress_tokens=_token_ids(
            "begin_suppress_tokens",
            generation.get("begin_suppress_tokens", cfg.get("begin_suppress_tokens")),
        ),
    )
    return multimodal, {**cfg, **decoder}


# Gemma 3's Pan-and-Scan: at most this many crops beside the image itself, each framed
# by a few text tokens (HF's Gemma3Processor.replace_image_token).
_GEMMA3_MAX_CROPS = 4
_GEMMA3_CROP_TEXT_TOKENS = 32


def gemma3_multimodal(cfg: dict[str, Any]) -> MultiModalArch:
    if not isinstance(cfg.get("text_config"), dict) or not isinstance(
        cfg.get("vision_config"), dict
    ):
        raise ValueError("a Gemma 3 VLM config needs text_config and vision_config")
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    return MultiModalArch(
        vision_config=dict(cfg["vision_config"]),
        mm_tokens_per_image=tokens,
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262144))),
        boi_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255999))),
        eoi_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256000))),
        bidirectional_items=True,
        max_tokens_per_item=(tokens + _GEMMA3_CROP_TEXT_TOKENS) * (1 + _GEMMA3_MAX_CROPS),
    )
