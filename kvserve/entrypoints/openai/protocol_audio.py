"""`POST /v1/audio/transcriptions` and `/v1/audio/translations`: the multipart form the
openai SDK sends (a `file` part and text fields) and the reply shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData, UploadFile

from kvserve.entrypoints.openai.protocol import OpenAIServingError

AudioResponseFormat = Literal["json", "text", "verbose_json"]


class TranscriptionRequest(BaseModel):
    """The form's text fields (OpenAI's names); the audio travels beside it."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: AudioResponseFormat = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=1.0)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TranscriptionResponse(BaseModel):
    text: str


class TranscriptionSegment(BaseModel):
    id: int
    seek: int = 0
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


class TranscriptionResponseVerbose(BaseModel):
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]


async def parse_audio_form(
    form: FormData, max_file_bytes: int
) -> tuple[TranscriptionRequest, bytes]:
    """The request and the uploaded file's bytes; a 400 naming the field otherwise. The
    file's size is checked before it is read into memory (it is spooled to disk)."""
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise OpenAIServingError("file: an audio file upload is required", param="file")
    if upload.size is not None and upload.size > max_file_bytes:
        raise OpenAIServingError(
            f"file: the file has {upload.size} bytes, more than the limit of {max_file_bytes}",
            param="file",
        )
    fields: dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str)}
    try:
        request = TranscriptionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(p) for p in error.get("loc", ())) or "body"
        raise OpenAIServingError(f"{loc}: {error['msg']}", param=loc.split(".")[0]) from None
    return request, await upload.read()
