"""A tiny random Gemma 3 vision-language checkpoint built with transformers: a byte-level
tokenizer with Gemma's special tokens, transformers' own Gemma3Processor (28-pixel
images, 4 soft tokens per image, Pan-and-Scan with 8-pixel minimum crops), a chat
template that places ``<start_of_image>`` for image parts, and HF's greedy reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.byte_level_tokenizer import byte_level_tokenizer

SPECIALS = [
    "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
]  # fmt: skip
BOI_ID, EOI_ID, IMAGE_ID = 6, 7, 8
TOKENS_PER_IMAGE = 4
VOCAB_SIZE = 300
IMAGE_SIZE = 28
# Pan-and-Scan settings a request passes (the processor class's defaults crop at 256 px).
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _tokenizer() -> Any:
    return byte_level_tokenizer(
        SPECIALS, VOCAB_SIZE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )  # fmt: skip


def build_gemma3_vlm(directory: Path) -> tuple[Any, Any]:
    """Saves the checkpoint, tokenizer and processor config to ``directory``; returns
    (HF model in eval mode, HF processor)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": VOCAB_SIZE, "sliding_window": 16, "max_position_embeddings": 1024,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": 7,
        },
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_id=BOI_ID, eoi_token_id=EOI_ID,
        image_token_id=IMAGE_ID, tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF zeros the projector and small inits hide the image
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name or "embed_tokens" in name:
                param.normal_(0, 0.5)
            elif ("language_model" in name or "lm_head" in name) and param.dim() == 2:
                param.normal_(0, 0.15)
    model.save_pretrained(directory)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=_tokenizer(),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(directory)
    # The engine reads the text numbers from config.json: make sure they are there.
    saved = json.loads((directory / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"], saved["architectures"]
    return model, processor


def random_image(seed: int, width: int = 40, height: int = 40) -> Any:
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


@torch.inference_mode()
def hf_greedy(
    model: Any, processor: Any, prompt: str, images: list[Any], max_tokens: int, **kwargs: Any
) -> tuple[list[int], list[int]]:
    """(prompt ids, HF's max_tokens greedy tokens) through HF's processor and model."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt", **kwargs)
    ids = inputs["input_ids"]
    extra = {}
    if images:
        extra = {"pixel_values": inputs["pixel_values"], "token_type_ids": inputs["token_type_ids"]}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **extra)
    cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_tokens:
        out = model(input_ids=torch.tensor([tokens[-1:]]), cache=cache, use_cache=True)
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return ids[0].tolist(), tokens
