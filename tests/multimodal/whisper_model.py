"""A tiny random Whisper checkpoint built with transformers (no hub): ``WhisperConfig``
with tiny dimensions, transformers' own ``WhisperFeatureExtractor`` cut to one-second
windows of 16 mel bins, a byte-level BPE tokenizer with Whisper's special tokens, and
HF's greedy reference over the same log-mel features."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.byte_level_tokenizer import byte_level_tokenizer

SAMPLING_RATE = 16000
CHUNK_SECONDS = 1  # the feature extractor's window: 100 frames, 50 encoder positions
NUM_MEL_BINS = 16
LANGUAGES = ("en", "fr", "de")
SPECIALS = [
    "<|endoftext|>", "<|startoftranscript|>", *(f"<|{lang}|>" for lang in LANGUAGES),
    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
    "<|notimestamps|>",
]  # fmt: skip
VOCAB_SIZE = 300
EOT_ID = 0
SOT_ID = 1
DECODER_START = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def _tokenizer() -> Any:
    return byte_level_tokenizer(
        SPECIALS, VOCAB_SIZE, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )  # fmt: skip


def build_whisper(
    directory: Path,
    suppress_tokens: list[int] | None = None,
    begin_suppress_tokens: list[int] | None = None,
) -> tuple[Any, Any]:
    """Saves the checkpoint, tokenizer and feature extractor to ``directory``; returns
    (HF model in eval mode, HF feature extractor). The same weights whatever the
    generation config's suppressed tokens (none by default)."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(0)
    frames = CHUNK_SECONDS * SAMPLING_RATE // 160
    config = WhisperConfig(
        vocab_size=VOCAB_SIZE, num_mel_bins=NUM_MEL_BINS, d_model=64,
        encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
        max_source_positions=frames // 2, max_target_positions=128,
        decoder_start_token_id=SOT_ID, eos_token_id=EOT_ID, bos_token_id=EOT_ID,
        pad_token_id=EOT_ID, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    # Larger random weights than the default init, so greedy tokens vary with the audio.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.generation_config.forced_decoder_ids = None
    model.generation_config.suppress_tokens = suppress_tokens
    model.generation_config.begin_suppress_tokens = begin_suppress_tokens
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    extractor = WhisperFeatureExtractor(
        feature_size=NUM_MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=CHUNK_SECONDS
    )
    extractor.save_pretrained(directory)
    return model, extractor


def random_audio(seed: int, seconds: float = 0.6) -> np.ndarray:
    """A float32 waveform at 16 kHz: a few tones plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    freqs = rng.uniform(100, 4000, 3)
    wave = sum(np.sin(2 * np.pi * f * t) for f in freqs) / 3
    return (0.5 * wave + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def hf_greedy(
    model: Any, extractor: Any, audio: np.ndarray, prefix: list[int], max_tokens: int
) -> list[int]:
    """HF's greedy tokens after ``prefix`` for the audio's log-mel features (the plain
    generation loop: Whisper's own ``generate`` wraps it with language detection and
    timestamp logic, which kvserve leaves off)."""
    from transformers.generation.utils import GenerationMixin

    features = extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    with torch.no_grad():
        out = GenerationMixin.generate(
            model,
            input_features=features,
            decoder_input_ids=torch.tensor([prefix]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=EOT_ID,
        )
    return [int(t) for t in out[0, len(prefix) :]]
