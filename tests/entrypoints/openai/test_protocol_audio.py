"""parse_audio_form: the upload's size is refused before it is read, a form without a
file and bad fields are 400s naming the field, a good form gives the request and bytes."""

from __future__ import annotations

import asyncio
import io

import pytest
from starlette.datastructures import FormData, UploadFile

from kvserve.entrypoints.openai.protocol import OpenAIServingError
from kvserve.entrypoints.openai.protocol_audio import parse_audio_form


def _form(data: bytes | None, **fields: str) -> FormData:
    items: list[tuple[str, str | UploadFile]] = list(fields.items())
    if data is not None:
        items.append(("file", UploadFile(io.BytesIO(data), size=len(data), filename="a.wav")))
    return FormData(items)


def test_good_form() -> None:
    request, data = asyncio.run(
        parse_audio_form(_form(b"RIFF", language="fr", response_format="text"), 100)
    )
    assert (request.language, request.response_format, request.temperature) == ("fr", "text", 0)
    assert data == b"RIFF"


@pytest.mark.parametrize(
    ("form", "param", "match"),
    [
        (_form(b"x" * 101), "file", "101 bytes, more than the limit of 100"),
        (_form(None, model="m"), "file", "file upload is required"),
        (_form(b"x", temperature="2"), "temperature", "temperature"),
        (_form(b"x", response_format="srt"), "response_format", "response_format"),
    ],
    ids=["too_large", "no_file", "temperature", "format"],
)
def test_bad_forms_are_400s_naming_the_field(form: FormData, param: str, match: str) -> None:
    with pytest.raises(OpenAIServingError, match=match) as info:
        asyncio.run(parse_audio_form(form, 100))
    assert (info.value.status, info.value.param) == (400, param)
