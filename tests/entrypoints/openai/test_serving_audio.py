"""/v1/audio/transcriptions and /v1/audio/translations through a real `kvserve serve`
process serving a tiny random Whisper, with the official openai client: wav, flac and
mp3 uploads give HF's greedy text for the decoded samples, in json, text and
verbose_json; the language and the task pick Whisper's prefix; the same audio twice
runs the encoder once. Not audio, an empty file, audio over the model's window, a
decompression bomb (a 14 kB FLAC of 10 minutes), a missing file, a JSON body, an
unknown language and a bad temperature each get a 400 in OpenAI's error shape, and the
server keeps serving with nothing left held (request census)."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile

from kvserve.utils.census import leftovers
from tests.entrypoints.openai.utils import RemoteServer
from tests.multimodal.whisper_model import SAMPLING_RATE, build_whisper, hf_greedy, random_audio

pytestmark = pytest.mark.slow

PREFIX = "<|startoftranscript|><|{lang}|><|{task}|><|notimestamps|>"
# A short context keeps every reply (and HF's reference) at most 12 tokens.
MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def whisper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteServer, Any]]:
    root = tmp_path_factory.mktemp("whisper_server")
    model, extractor = build_whisper(root)
    from transformers import AutoTokenizer

    server = RemoteServer(
        str(root),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-request-census",
        "--max-num-batched-tokens",
        "64",
    )
    yield server, (model, extractor, AutoTokenizer.from_pretrained(root))
    server.stop()


def _encode(wave: np.ndarray, fmt: str, rate: int = SAMPLING_RATE) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt)
    return buf.getvalue()


def _expected(reference: Any, data: bytes, lang: str = "en", task: str = "transcribe") -> str:
    """HF's greedy text for the samples soundfile decodes from ``data``."""
    model, extractor, tokenizer = reference
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert rate == SAMPLING_RATE
    prefix = tokenizer.encode(PREFIX.format(lang=lang, task=task), add_special_tokens=False)
    limit = MAX_MODEL_LEN - len(prefix)
    tokens = hf_greedy(model, extractor, samples.mean(axis=1), prefix, limit)
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "MP3"])
def test_transcription_matches_hf(whisper_server: tuple[RemoteServer, Any], fmt: str) -> None:
    server, reference = whisper_server
    client = server.client()
    data = _encode(random_audio(3), fmt)
    result = client.audio.transcriptions.create(
        model=_model(client), file=(f"clip.{fmt.lower()}", data), temperature=0.0
    )
    assert result.text == _expected(reference, data)


def test_response_formats_language_and_translation(
    whisper_server: tuple[RemoteServer, Any],
) -> None:
    server, reference = whisper_server
    client = server.client()
    model = _model(client)
    data = _encode(random_audio(5), "WAV")
    expected = _expected(reference, data)
    text = client.audio.transcriptions.create(
        model=model, file=("a.wav", data), response_format="text"
    )
    assert text == expected
    verbose = client.audio.transcriptions.create(
        model=model, file=("a.wav", data), response_format="verbose_json"
    )
    assert (verbose.text, verbose.language, verbose.duration) == (expected, "en", 0.6)
    assert verbose.segments is not None and verbose.segments[0].text == expected
    french = client.audio.transcriptions.create(model=model, file=("a.wav", data), language="fr")
    assert french.text == _expected(reference, data, lang="fr")
    translated = client.audio.translations.create(model=model, file=("a.wav", data))
    assert translated.text == _expected(reference, data, task="translate")


def test_same_audio_runs_the_encoder_once(whisper_server: tuple[RemoteServer, Any]) -> None:
    server, _ = whisper_server
    client = server.client()
    data = _encode(random_audio(9), "FLAC")
    before = server.metrics().get("kvserve:mm_vision_tower_runs_total", 0.0)
    for _ in range(2):
        client.audio.transcriptions.create(model=_model(client), file=("a.flac", data))
    server.wait_for_metrics(10.0, mm_vision_tower_runs_total=before + 1)


def _bomb() -> bytes:
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", samplerate=8000, channels=1, format="FLAC") as f:
        silence = np.zeros(8000 * 60, np.float32)
        for _ in range(10):
            f.write(silence)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("files", "data", "match", "param"),
    [
        ({"file": ("a.wav", b"not audio at all")}, {}, "not a readable audio file", "file"),
        ({"file": ("a.wav", b"")}, {}, "empty", "file"),
        ({"file": ("a.wav", _encode(random_audio(1, seconds=2.0), "WAV"))}, {}, "limit", "file"),
        ({"file": ("a.flac", _bomb())}, {}, r"600\.0 s, more than the limit of 1 s", "file"),
        (None, {"model": "m"}, "file", "file"),
        ({"file": ("a.wav", _encode(random_audio(1), "WAV"))}, {"language": "xx"}, "xx", "language"),
        ({"file": ("a.wav", _encode(random_audio(1), "WAV"))}, {"temperature": "5"}, "temp", "temperature"),
    ],
    ids=["not_audio", "empty", "too_long", "bomb", "no_file", "language", "temperature"],
)  # fmt: skip
def test_bad_uploads_are_400s(
    whisper_server: tuple[RemoteServer, Any],
    files: dict[str, Any] | None,
    data: dict[str, str],
    match: str,
    param: str,
) -> None:
    server, _ = whisper_server
    url = server.url("/v1/audio/transcriptions")
    if files is None:  # a multipart form without the file part
        response = httpx.post(url, files={"model": (None, "m")}, timeout=30)
    else:
        response = httpx.post(url, files=files, data=data, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param
    assert re.search(match, error["message"]), error["message"]


def test_json_body_sdk_error_and_still_serving(whisper_server: tuple[RemoteServer, Any]) -> None:
    server, reference = whisper_server
    response = httpx.post(
        server.url("/v1/audio/transcriptions"), json={"file": "x", "model": "m"}, timeout=30
    )
    assert (
        response.status_code == 400 and "multipart/form-data" in response.json()["error"]["message"]
    )
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="not a readable audio file"):
        client.audio.transcriptions.create(model=_model(client), file=("x.mp3", b"\x00" * 64))
    # After every bad upload above, the server still serves.
    good = _encode(random_audio(2), "WAV")
    text = client.audio.transcriptions.create(model=_model(client), file=("b.wav", good)).text
    assert text == _expected(reference, good)
    # Nothing is left held: no request state, no block, no encoder key (census).
    deadline = time.monotonic() + 30
    left = leftovers(httpx.get(server.url("/debug/census"), timeout=30).json())
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftovers(httpx.get(server.url("/debug/census"), timeout=30).json())
    assert left == {}
