"""Multimodal processors: prompt text + images -> token ids with the image placeholders
expanded, the items' processed inputs (pixel values) and where each item sits.

One processor class per model architecture (``MULTIMODAL_PROCESSORS``, vLLM's processor
registry). Gemma 3's uses transformers' own ``Gemma3Processor`` from the model
directory (its image processor config: size, normalisation, Pan-and-Scan), item by item,
so a cached item skips the image processor and only the text is tokenized again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.multimodal.hasher import MultiModalHasher
from kvserve.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from kvserve.multimodal.media import MediaPolicy, to_rgb_array
from kvserve.multimodal.processor_cache import ItemData, ProcessorCache


@dataclass
class ProcessedPrompt:
    prompt_text: str
    token_ids: list[int]
    features: list[MultiModalFeatureSpec]


class MultiModalProcessor:
    """Base: what the input processor calls. Subclasses fill in one model's rules."""

    modalities: tuple[str, ...] = ("image",)

    def __init__(self, model_dir: str, policy: MediaPolicy, cache: ProcessorCache) -> None:
        self.model_dir = model_dir
        self.policy = policy
        self.cache = cache
        self.num_processed = 0  # items that ran the image processor (cache misses)

    def process(
        self,
        prompt: str,
        mm_data: Mapping[str, Sequence[object]],
        mm_processor_kwargs: Mapping[str, Any] | None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> ProcessedPrompt:
        """``add_special_tokens``: False for a chat template's text (it holds BOS).
        ``cache_salt``: hashed into every item's identifier, so that requests of different
        salts (tenants) share no processor-cache, encoder-cache or EC-connector entry."""
        unknown = sorted(set(mm_data) - set(self.modalities))
        if unknown:
            raise ValueError(
                f"multi_modal_data: unsupported modality {unknown[0]!r} "
                f"({' and '.join(self.modalities)} only)"
            )
        return self._process(prompt, mm_data, mm_processor_kwargs, add_special_tokens, cache_salt)

    def _process(
        self,
        prompt: str,
        mm_data: Mapping[str, Sequence[object]],
        mm_processor_kwargs: Mapping[str, Any] | None,
        add_special_tokens: bool,
        cache_salt: str | None,
    ) -> ProcessedPrompt:
        raise NotImplementedError


def _as_items(field: str, value: object) -> list[object]:
    return list(value) if isinstance(value, list | tuple) else [value]


class Gemma3MultiModalProcessor(MultiModalProcessor):
    # Keyword arguments a request may set (they change the pixels, so they are hashed).
    _ALLOWED_KWARGS = frozenset(
        {
            "do_pan_and_scan",
            "pan_and_scan_min_crop_size",
            "pan_and_scan_max_num_crops",
            "pan_and_scan_min_ratio_to_activate",
        }
    )

    def __init__(self, model_dir: str, policy: MediaPolicy, cache: ProcessorCache) -> None:
        super().__init__(model_dir, policy, cache)
        from transformers import AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_dir)
        tok = self.hf.tokenizer
        self.tokenizer = tok
        self.boi_token: str = tok.boi_token
        self.image_token_id: int = tok.image_token_id
        self.tokens_per_image: int = self.hf.image_seq_length
        # The processor config's own defaults (preprocessor_config.json) for the kwargs.
        self.default_kwargs = {
            k: v
            for k in self._ALLOWED_KWARGS
            if (v := getattr(self.hf.image_processor, k, None)) is not None
        }

    def _kwargs(self, request_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        kwargs = dict(self.default_kwargs)
        for key, value in (request_kwargs or {}).items():
            if key not in self._ALLOWED_KWARGS:
                raise ValueError(
                    f"mm_processor_kwargs: unknown key {key!r} for Gemma 3 "
                    f"(known: {', '.join(sorted(self._ALLOWED_KWARGS))})"
                )
            kwargs[key] = value
        return kwargs

    def _process_item(self, field: str, pixels: np.ndarray, kwargs: dict[str, Any]) -> ItemData:
        from PIL import Image

        try:
            out = self.hf(images=[Image.fromarray(pixels)], return_tensors="np", **kwargs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{field}: the image processor failed: {e}") from None
        self.num_processed += 1
        return {"pixel_values": TensorData.from_array(np.asarray(out["pixel_values"]))}

    def _process(
        self,
        prompt: str,
        mm_data: Mapping[str, Sequence[object]],
        mm_processor_kwargs: Mapping[str, Any] | None,
        add_special_tokens: bool,
        cache_salt: str | None,
    ) -> ProcessedPrompt:
        images = _as_items("image", mm_data.get("image", []))
        kwargs = self._kwargs(mm_processor_kwargs)
        num_markers = prompt.count(self.boi_token)
        if num_markers != len(images):
            raise ValueError(
                f"the prompt has {num_markers} {self.boi_token} placeholder(s) for "
                f"{len(images)} image(s) in multi_modal_data['image']"
            )
        hashes: list[str] = []
        datas: list[ItemData] = []
        for i, image in enumerate(images):
            field = f"multi_modal_data['image'][{i}]"
            pixels = to_rgb_array(field, image, self.policy)
            salt = {} if cache_salt is None else {"cache_salt": cache_salt}
            mm_hash = MultiModalHasher.hash_kwargs(image=pixels, **kwargs, **salt)
            data = self.cache.peek(mm_hash)
            if data is None:
                data = self._process_item(field, pixels, kwargs)
            hashes.append(mm_hash)
            datas.append(data)
        # Expand each marker as HF's processor does (original image, then its crops).
        pieces = prompt.split(self.boi_token)
        text = pieces[0]
        for i, piece in enumerate(pieces[1:]):
            num_crops = datas[i]["pixel_values"].shape[0] - 1
            text += self.hf.replace_image_token({"num_crops": [num_crops]}, 0) + piece
        token_ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ranges = self._placeholders(token_ids, [d["pixel_values"].shape[0] for d in datas])
        features = [
            MultiModalFeatureSpec("image", mm_hash, rng, data)
            for mm_hash, rng, data in zip(hashes, ranges, datas, strict=True)
        ]
        return ProcessedPrompt(text, token_ids, features)

    def _placeholders(self, ids: list[int], blocks_per_image: list[int]) -> list[PlaceholderRange]:
        """One range per image over its soft-token runs (crops included); the text
        between crops' runs is inside the range but not embedded (is_embed)."""
        arr = np.asarray(ids) == self.image_token_id
        edges = np.flatnonzero(np.diff(np.concatenate(([0], arr.astype(np.int8), [0]))))
        runs = list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
        if len(runs) != sum(blocks_per_image) or any(
            e - s != self.tokens_per_image for s, e in runs
        ):
            raise ValueError(
                "the prompt's image tokens do not match its images (does the text contain "
                "image soft tokens of its own?)"
            )
        ranges = []
        for n in blocks_per_image:
            mine, runs = runs[:n], runs[n:]
            start, end = mine[0][0], mine[-1][1]
            is_embed = None if n == 1 else tuple(bool(x) for x in arr[start:end])
            ranges.append(PlaceholderRange(start, end - start, is_embed))
        return ranges


class WhisperMultiModalProcessor(MultiModalProcessor):
    """One audio clip per prompt: ``(waveform, sampling_rate)`` or a waveform at the
    feature extractor's rate, resampled to that rate, turned into log-mel features by
    transformers' ``WhisperFeatureExtractor`` from the model directory. The prompt is the
    decoder's text (``<|startoftranscript|>...``), tokenized without added tokens; the
    audio takes no decoder position (its encoder output is cross-attended)."""

    modalities = ("audio",)

    def __init__(self, model_dir: str, policy: MediaPolicy, cache: ProcessorCache) -> None:
        super().__init__(model_dir, policy, cache)
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        self.extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.sampling_rate = int(self.extractor.sampling_rate)
        self.window_samples = int(self.extractor.n_samples)
        self.encoder_len = int(self.extractor.nb_max_frames) // 2

    def waveform(self, field: str, item: object) -> np.ndarray:
        """The item's samples at the model's rate, within its window."""
        from kvserve.multimodal.audio import resample, to_waveform

        rate = self.sampling_rate
        if isinstance(item, tuple):
            if len(item) != 2 or isinstance(item[1], bool) or not isinstance(item[1], int):
                raise ValueError(f"{field}: audio must be (samples, sampling_rate: int)")
            item, rate = item
            if rate <= 0:
                raise ValueError(f"{field}: sampling_rate must be positive, got {rate}")
        wave = resample(to_waveform(field, item), rate, self.sampling_rate)
        if wave.shape[0] > self.window_samples:
            raise ValueError(
                f"{field}: the audio lasts {wave.shape[0] / self.sampling_rate:.1f} s, more "
                f"than the model's window of {self.window_samples / self.sampling_rate:g} s"
            )
        return wave

    def _process(
        self,
        prompt: str,
        mm_data: Mapping[str, Sequence[object]],
        mm_processor_kwargs: Mapping[str, Any] | None,
        add_special_tokens: bool,
        cache_salt: str | None,
    ) -> ProcessedPrompt:
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: Whisper takes none")
        items = _as_items("audio", mm_data.get("audio", []))
        if len(items) != 1:
            raise ValueError(f"multi_modal_data['audio'] needs exactly one clip, got {len(items)}")
        field = "multi_modal_data['audio'][0]"
        wave = self.waveform(field, items[0])
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        mm_hash = MultiModalHasher.hash_kwargs(audio=wave, sampling_rate=self.sampling_rate, **salt)
        data = self.cache.peek(mm_hash)
        if data is None:
            out = self.extractor(wave, sampling_rate=self.sampling_rate, return_tensors="np")
            data = {"input_features": TensorData.from_array(np.asarray(out["input_features"]))}
            self.num_processed += 1
        token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        feature = MultiModalFeatureSpec(
            "audio", mm_hash, PlaceholderRange(0, self.encoder_len), data
        )
        return ProcessedPrompt(prompt, token_ids, [feature])


# Architecture (config.json) -> processor class.
MULTIMODAL_PROCESSORS: dict[str, type[MultiModalProcessor]] = {
    "Gemma3ForConditionalGeneration": Gemma3MultiModalProcessor,
    "WhisperForConditionalGeneration": WhisperMultiModalProcessor,
}


def is_multimodal_arch(architecture: str) -> bool:
    return architecture in MULTIMODAL_PROCESSORS


def create_processor(
    architecture: str, model_dir: str, policy: MediaPolicy, cache: ProcessorCache
) -> MultiModalProcessor:
    cls = MULTIMODAL_PROCESSORS.get(architecture)
    if cls is None:
        raise ValueError(f"{architecture} takes no multimodal input")
    return cls(model_dir, policy, cache)
