"""Audio inputs: encoded files (wav, flac, mp3, ogg: whatever libsndfile reads) decoded
with soundfile, waveforms checked and resampled to a model's rate with scipy.

Limits are checked before the samples are decoded: the header's frame count bounds the
work, so a small compressed file that would decode to hours (a decompression bomb) is
refused from its header alone.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AudioPolicy:
    """The longest audio accepted, in seconds, and the largest encoded file in bytes."""

    max_audio_seconds: float = 30.0
    max_file_bytes: int = 25 << 20  # OpenAI's upload limit


def decode_audio_file(field: str, data: bytes, policy: AudioPolicy) -> tuple[np.ndarray, int]:
    """Encoded audio -> (mono float32 waveform, sampling rate); ValueError naming
    ``field`` for anything that is not audio, empty, too large or too long."""
    import soundfile

    if not data:
        raise ValueError(f"{field}: the file is empty")
    if len(data) > policy.max_file_bytes:
        raise ValueError(
            f"{field}: the file has {len(data)} bytes, more than the limit of "
            f"{policy.max_file_bytes}"
        )
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames = int(f.samplerate), int(f.frames)
            if rate <= 0:
                raise ValueError(f"{field}: the audio has no sampling rate")
            # Checked from the header, before anything is decoded (decompression bombs).
            check_duration(field, frames, rate, policy)
            samples = f.read(dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"{field}: not a readable audio file ({e})") from None
    # The header's count may understate what a broken stream yields: check what came.
    check_duration(field, samples.shape[0], rate, policy)
    return to_waveform(field, samples.mean(axis=1)), rate


def check_duration(field: str, num_samples: int, rate: int, policy: AudioPolicy) -> None:
    if num_samples <= 0:
        raise ValueError(f"{field}: the audio is empty")
    seconds = num_samples / rate
    if seconds > policy.max_audio_seconds:
        raise ValueError(
            f"{field}: the audio lasts {seconds:.1f} s, more than the limit of "
            f"{policy.max_audio_seconds:g} s"
        )


def to_waveform(field: str, value: object) -> np.ndarray:
    """A 1-D finite float32 array from an array-like of samples."""
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: audio samples must be numbers") from None
    if array.ndim != 1:
        raise ValueError(f"{field}: audio must be one channel of samples, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{field}: the audio is empty")
    if not np.isfinite(array).all():
        raise ValueError(f"{field}: the audio holds NaN or infinite samples")
    return array


def resample(waveform: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Polyphase resampling (scipy) from ``rate`` to ``target_rate``."""
    if rate == target_rate:
        return waveform
    from scipy.signal import resample_poly

    g = math.gcd(rate, target_rate)
    return np.asarray(resample_poly(waveform, target_rate // g, rate // g), dtype=np.float32)
