"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` for encoder-decoder speech
models (Whisper): the uploaded file decoded (soundfile), checked against the model's
window, and run as one request whose decoder prompt is Whisper's task prefix
(``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``: timestamps off)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from kvserve.engine.engine_client import EngineClient
from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.protocol_audio import (
    TranscriptionRequest,
    TranscriptionResponse,
    TranscriptionResponseVerbose,
    TranscriptionSegment,
)
from kvserve.entrypoints.openai.serving_engine import OpenAIServing
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.entrypoints.openai.tenants import tenant_cache_salt
from kvserve.multimodal.audio import AudioPolicy, decode_audio_file
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Task = Literal["transcribe", "translate"]
DEFAULT_LANGUAGE = "en"


class OpenAIServingTranscription(OpenAIServing):
    def __init__(self, engine_client: EngineClient, models: OpenAIServingModels) -> None:
        super().__init__(engine_client, models)
        mm = engine_client.model_config.arch.multimodal
        self.supported = mm is not None and mm.encoder_decoder
        # The window Whisper's feature extractor pads to (30 s): longer audio is refused.
        seconds = _window_seconds(engine_client) if self.supported else 30.0
        self.policy = AudioPolicy(max_audio_seconds=seconds)

    async def create(
        self,
        request: TranscriptionRequest,
        audio: bytes,
        raw_request: Request | None,
        task: Task,
    ) -> Response | TranscriptionResponse | TranscriptionResponseVerbose:
        """Raises OpenAIServingError (400 for bad input or a model without audio)."""
        model = self.models.resolve(request.model)
        if not self.supported:
            raise OpenAIServingError(
                f"model {model} does not take audio (no encoder-decoder speech model)",
                param="model",
            )
        try:
            wave, rate = await asyncio.to_thread(decode_audio_file, "file", audio, self.policy)
        except ValueError as exc:
            raise OpenAIServingError(str(exc), param="file") from None
        language = request.language or DEFAULT_LANGUAGE
        prompt = self._decoder_prompt(language, task, request.prompt)
        num_prompt = len(await self.tokenize(prompt, add_special_tokens=False))
        max_tokens = self.check_length(num_prompt, request.max_completion_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        request_id = self.request_id(raw_request, None, "trsc")
        outputs = self.engine_client.generate(
            {"prompt": prompt, "multi_modal_data": {"audio": (wave, rate)}},
            params,
            request_id,
            cache_salt=tenant_cache_salt(None),
        )
        final: RequestOutput | None = None
        try:
            async with contextlib.aclosing(outputs) as stream:
                async for output in stream:
                    final = output
        except Exception as exc:
            raise self.engine_error(exc) from None
        assert final is not None
        self.check_output(final)
        completion = final.outputs[0]
        text = completion.text
        if request.response_format == "text":
            return PlainTextResponse(text)
        if request.response_format == "json":
            return TranscriptionResponse(text=text)
        duration = wave.shape[0] / rate
        segment = TranscriptionSegment(
            id=0,
            start=0.0,
            end=round(duration, 3),
            text=text,
            tokens=list(completion.token_ids),
            temperature=request.temperature,
        )
        return TranscriptionResponseVerbose(
            task=task, language=language, duration=duration, text=text, segments=[segment]
        )

    def _decoder_prompt(self, language: str, task: Task, previous: str | None) -> str:
        """Whisper's prefix; ``previous`` (OpenAI's ``prompt``) goes before it as the
        text of a previous window (``<|startofprev|>``)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise OpenAIServingError("audio needs the model's tokenizer", status=500)
        vocab = tokenizer.get_vocab()
        language_token = f"<|{language}|>"
        if language_token not in vocab:
            raise OpenAIServingError(
                f"language: {language!r} is not one of the model's languages", param="language"
            )
        prefix = f"<|startoftranscript|>{language_token}<|{task}|><|notimestamps|>"
        if previous:
            return f"<|startofprev|> {previous.strip()}{prefix}"
        return prefix


def _window_seconds(engine_client: EngineClient) -> float:
    """The feature extractor's window (chunk_length), read from the model directory."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(engine_client.model_config.resolved.path)
    return float(extractor.n_samples) / float(extractor.sampling_rate)
